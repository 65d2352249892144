/**
 * What the sidebar and the status bar compute from the server's answers: pure functions,
 * no JupyterLab imports, so `npm test` checks them under Node alone.
 *
 * Example:
 *   statusText([{state: 'running', world_size: 2}]) === 'nbtrain: 1 run · 2 ranks'
 */

/** One run as `GET nbtrain/api/runs` returns it (the fields the sidebar uses). */
export interface RunInfo {
  id: string;
  state: string;
  world_size: number;
  kernel_id?: string | null;
  notebook?: string | null;
  /** The notebook as the contents API names it (relative to the server's root): what Open opens. */
  path?: string | null;
  strategy?: string;
  accelerator?: string;
  pids?: number[];
  live_pids?: number[];
  step?: number | null;
  loss?: number | null;
  losses?: number[];
  steps_per_second?: number | null;
  elapsed?: number;
  /** The optimizer step a stop kept: every rank ended there and the kernel holds its state. */
  stopped_at?: number | null;
  /** A failed run's root-cause rank kept alive for %nbtrain_debug, and what it holds; null once released. */
  held?: string | null;
  /**
   * On a machine of several people: what other users could reach of this run's process group,
   * why, and what to do (the kernel's own sentence, nbtrain.system.sharedhost); null where nobody could.
   */
  shared_host?: string | null;
}

export interface GpuInfo {
  index: number;
  name: string;
  memory_used: number;
  memory_total: number;
  utilization: number | null;
}

export interface DevicesInfo {
  gpus: GpuInfo[];
  host: { cpus: number; cpu_percent: number; memory_used: number; memory_total: number };
  ranks: { run: string; rank: number; pid: number; rss: number | null; gpu_memory: number | null }[];
}

/** What the sidebar says above the runs about other users of this machine: each run's sentence once. */
export function sharedHostText(runs: Pick<RunInfo, 'shared_host'>[]): string {
  const said: string[] = [];
  for (const run of runs) {
    if (run.shared_host && said.indexOf(run.shared_host) < 0) {
      said.push(run.shared_host);
    }
  }
  return said.join(' ');
}

/** States in which a run still has ranks working for it. */
export const ACTIVE_STATES = ['starting', 'running', 'stopping'];

export function isActive(run: Pick<RunInfo, 'state'>): boolean {
  return ACTIVE_STATES.indexOf(run.state) >= 0;
}

/** The state as the sidebar says it: "stopped at step 412" for a stop that kept its step. */
export function stateText(run: Pick<RunInfo, 'state' | 'stopped_at'>): string {
  return run.stopped_at !== null && run.stopped_at !== undefined ? `${run.state} at step ${run.stopped_at}` : run.state;
}

/**
 * The line under a failed run's state naming the rank kept for a post-mortem and what it
 * holds (the server's words), and how to free it; "" when no rank is held.
 */
export function heldText(run: Pick<RunInfo, 'held'>): string {
  return run.held ? `Held: ${run.held}. %nbtrain_debug opens it; Dismiss releases it.` : '';
}

/** What a run's button does: stop a run still going, else forget it (killing what is left of it). */
export interface RunAction {
  label: string;
  hint: string;
  action: 'stop' | 'clean';
}

export function actionFor(run: Pick<RunInfo, 'state' | 'held'>): RunAction {
  if (isActive(run) && run.state !== 'stopping') {
    return { label: 'Stop', hint: 'Stop every rank of this run now (the kernel need not answer)', action: 'stop' };
  }
  if (run.state === 'orphaned') {
    return { label: 'Clean up', hint: 'Its kernel is gone: kill what is left of its ranks and forget it', action: 'clean' };
  }
  const hint = run.held
    ? 'Release the rank held for %nbtrain_debug (its process ends, its memory is freed) and forget this run'
    : 'Forget this ended run';
  return { label: 'Dismiss', hint, action: 'clean' };
}

/** The status-bar text: "nbtrain: 1 run · 2 ranks" (active runs only); "" with none. */
export function statusText(runs: Pick<RunInfo, 'state' | 'world_size'>[]): string {
  const active = runs.filter(isActive);
  if (active.length === 0) {
    return '';
  }
  const ranks = active.reduce((sum, run) => sum + run.world_size, 0);
  return `nbtrain: ${plural(active.length, 'run')} · ${plural(ranks, 'rank')}`;
}

export function plural(count: number, noun: string): string {
  return `${count} ${noun}${count === 1 ? '' : 's'}`;
}

/** 75 -> "1:15", 3725 -> "1:02:05". */
export function formatElapsed(seconds: number): string {
  const total = Math.max(0, Math.floor(seconds));
  const h = Math.floor(total / 3600);
  const m = Math.floor((total % 3600) / 60);
  const s = total % 60;
  const mm = h > 0 ? String(m).padStart(2, '0') : String(m);
  return `${h > 0 ? h + ':' : ''}${mm}:${String(s).padStart(2, '0')}`;
}

/** 1536 -> "1.5 KiB"; null -> "–". */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined) {
    return '–';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${units[unit]}`;
}

/** A loss to show: 3 significant digits, "–" when unknown. */
export function formatLoss(loss: number | null | undefined): string {
  if (loss === null || loss === undefined || !isFinite(loss)) {
    return '–';
  }
  return Number(loss.toPrecision(3)).toString();
}

/**
 * The SVG polyline points of a sparkline of `values` in a `width` x `height` box
 * (the highest value at the top; a flat series in the middle); "" for fewer than 2 points.
 */
export function sparklinePoints(values: number[], width: number, height: number): string {
  const finite = values.filter(v => isFinite(v));
  if (finite.length < 2) {
    return '';
  }
  const low = Math.min(...finite);
  const high = Math.max(...finite);
  const step = width / (finite.length - 1);
  return finite
    .map((v, i) => {
      const y = high === low ? height / 2 : height - ((v - low) / (high - low)) * height;
      return `${round(i * step)},${round(y)}`;
    })
    .join(' ');
}

function round(value: number): number {
  return Math.round(value * 10) / 10;
}

/** The notebook's name for a run's row: its file name, or its kernel when the path is unknown. */
export function runTitle(run: Pick<RunInfo, 'notebook' | 'kernel_id' | 'id'>): string {
  if (run.notebook) {
    const parts = run.notebook.split('/');
    return parts[parts.length - 1];
  }
  return run.kernel_id ? `kernel ${run.kernel_id.slice(0, 8)}` : `run ${run.id}`;
}

/**
 * The first line of the cell the palette command inserts: the kernel's session defaults
 * (`nbtrain.get_defaults().magic_line()`, read from the kernel: it starts with the magic that
 * is nbtrain's there, `%%distributed` or, where another package holds that, `%%nbtrain`), or a
 * plain `%%nbtrain` (nbtrain's in every kernel; it uses them too) when the kernel could not say.
 */
export function distributedCell(magicLine: string | null | undefined): string {
  const line = (magicLine || '').trim();
  const first = /^%%(distributed|nbtrain)(\s|$)/.test(line) ? line : '%%nbtrain';
  return `${first}\n`;
}

/** The expression the command asks the kernel for, without importing (or starting) nbtrain. */
export const DEFAULTS_EXPRESSION =
  "__import__('sys').modules['nbtrain'].get_defaults().magic_line() if 'nbtrain' in __import__('sys').modules else ''";

/** Parse the text/plain repr of a Python str ("'%%distributed ...'") as the kernel returns it. */
export function parsePythonString(repr: string | undefined): string {
  if (!repr) {
    return '';
  }
  const quoted = /^(['"])(.*)\1$/s.exec(repr.trim());
  return quoted ? quoted[2].replace(/\\'/g, "'").replace(/\\\\/g, '\\') : '';
}
