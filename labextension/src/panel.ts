/**
 * The sidebar: every nbtrain run of this server's user (state, world size, steps/s, a loss
 * sparkline, elapsed time, a rank held for %nbtrain_debug, Stop, open the notebook) and the
 * devices (GPUs, host, ranks).
 * It asks the server every REFRESH_MS while it is visible, and not at all while hidden.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { fetchDevices, runAction } from './api';
import {
  DevicesInfo,
  RunInfo,
  actionFor,
  formatBytes,
  formatElapsed,
  formatLoss,
  heldText,
  plural,
  runTitle,
  sharedHostText,
  sparklinePoints,
  stateText
} from './model';
import { RunsModel } from './runsmodel';

export const REFRESH_MS = 2000;
const SPARK_WIDTH = 120;
const SPARK_HEIGHT = 24;

type Child = Node | string | null | undefined | false;

/** A DOM element with a class, attributes and children (text is never parsed as HTML). */
function h(tag: string, className: string, children: Child[] = [], attrs: Record<string, string> = {}): HTMLElement {
  const element = document.createElement(tag);
  element.className = className;
  for (const [name, value] of Object.entries(attrs)) {
    element.setAttribute(name, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined && child !== false) {
      element.append(child);
    }
  }
  return element;
}

export class NbtrainPanel extends Widget {
  private timer: number | undefined;
  private devices: DevicesInfo | null = null;
  private error = '';
  private readonly runsNode: HTMLElement;
  private readonly devicesNode: HTMLElement;
  private readonly messageNode: HTMLElement;
  private readonly sharedHostNode: HTMLElement;

  constructor(private readonly model: RunsModel, private readonly openNotebook: (path: string) => void) {
    super();
    this.id = 'nbtrain-sidebar';
    this.addClass('jp-nbtrain-panel');
    this.title.caption = 'nbtrain: runs and devices';
    this.messageNode = h('div', 'jp-nbtrain-message');
    this.sharedHostNode = h('div', 'jp-nbtrain-shared-host');
    this.runsNode = h('div', 'jp-nbtrain-runs');
    this.devicesNode = h('div', 'jp-nbtrain-devices');
    this.node.append(
      h('h2', 'jp-nbtrain-heading', ['nbtrain runs']),
      this.messageNode,
      this.sharedHostNode,
      this.runsNode,
      h('h2', 'jp-nbtrain-heading', ['Devices']),
      this.devicesNode
    );
    model.changed.connect(() => {
      if (this.isVisible) {
        this.renderRuns();
      }
    });
  }

  protected onAfterShow(msg: Message): void {
    void this.refresh();
    this.timer = window.setInterval(() => void this.refresh(), REFRESH_MS);
  }

  protected onBeforeHide(msg: Message): void {
    window.clearInterval(this.timer);
    this.timer = undefined;
  }

  dispose(): void {
    window.clearInterval(this.timer);
    super.dispose();
  }

  async refresh(): Promise<void> {
    await this.model.refresh();
    try {
      this.devices = await fetchDevices();
      this.error = '';
    } catch (error) {
      this.error = `nbtrain could not read the devices: ${error}`;
    }
    this.renderRuns();
    this.renderDevices();
  }

  private renderRuns(): void {
    const runs = this.model.runs;
    this.messageNode.textContent = this.model.error || this.error;
    this.sharedHostNode.textContent = sharedHostText(runs);
    this.runsNode.replaceChildren(
      ...(runs.length
        ? runs.slice().reverse().map(run => this.renderRun(run))
        : [h('div', 'jp-nbtrain-empty', ['No nbtrain run on this server yet. Run a %%distributed cell.'])])
    );
  }

  private renderRun(run: RunInfo): HTMLElement {
    const facts = [
      plural(run.world_size, 'rank'),
      run.accelerator,
      run.strategy,
      run.step !== null && run.step !== undefined ? `step ${run.step}` : '',
      run.steps_per_second ? `${run.steps_per_second.toFixed(1)} steps/s` : '',
      `loss ${formatLoss(run.loss)}`,
      formatElapsed(run.elapsed || 0)
    ].filter(Boolean);
    const points = sparklinePoints(run.losses || [], SPARK_WIDTH, SPARK_HEIGHT);
    const spark = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
    spark.setAttribute('class', 'jp-nbtrain-spark');
    spark.setAttribute('viewBox', `-1 -1 ${SPARK_WIDTH + 2} ${SPARK_HEIGHT + 2}`);
    spark.setAttribute('width', String(SPARK_WIDTH));
    spark.setAttribute('height', String(SPARK_HEIGHT));
    if (points) {
      const line = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
      line.setAttribute('points', points);
      spark.append(line);
    }
    const title = h('span', 'jp-nbtrain-title', [runTitle(run)], { title: run.notebook || run.kernel_id || run.id });
    // The server's path for it: the record's is a file system path, which the front end cannot open.
    const open = run.path ? h('button', 'jp-nbtrain-open jp-mod-styled', ['Open'], { title: `Open ${run.path}` }) : null;
    open?.addEventListener('click', () => this.openNotebook(run.path as string));
    const held = heldText(run);
    // A run other users could reach carries the sentence's bar: the sentence above says "this run".
    const reachable = run.shared_host ? ' jp-nbtrain-run-shared-host' : '';
    return h(
      'div',
      `jp-nbtrain-run${reachable}`,
      [
        h('div', 'jp-nbtrain-run-head', [
          title,
          h('span', `jp-nbtrain-state jp-nbtrain-state-${run.state.replace(/\s+/g, '-')}`, [stateText(run)])
        ]),
        held && h('div', 'jp-nbtrain-held', [held]),
        h('div', 'jp-nbtrain-facts', [facts.join(' · ')]),
        h('div', 'jp-nbtrain-run-foot', [spark, h('span', 'jp-nbtrain-buttons', [open, this.actionButton(run)])])
      ],
      {
        'data-run-id': run.id,
        'data-state': run.state,
        'data-world-size': String(run.world_size),
        ...(run.shared_host ? { title: 'Other users of this machine could reach this run: see the note above the runs.' } : {})
      }
    );
  }

  private actionButton(run: RunInfo): HTMLElement {
    const { label, hint, action } = actionFor(run);
    const button = h('button', `jp-nbtrain-action jp-mod-styled ${action === 'stop' ? 'jp-mod-warn' : ''}`, [label], {
      title: hint,
      'data-action': action
    }) as HTMLButtonElement;
    button.disabled = run.state === 'stopping';
    button.addEventListener('click', async () => {
      button.disabled = true;
      try {
        const outcome = await runAction(run.id, action);
        this.error = outcome.refused.length ? outcome.message : '';
      } catch (error) {
        this.error = String(error);
      }
      await this.model.refresh();
    });
    return button;
  }

  private renderDevices(): void {
    const devices = this.devices;
    if (!devices) {
      this.devicesNode.replaceChildren();
      return;
    }
    const gpus = devices.gpus.map(gpu =>
      h('div', 'jp-nbtrain-device', [
        `GPU ${gpu.index} ${gpu.name}: ${formatBytes(gpu.memory_used)} / ${formatBytes(gpu.memory_total)}` +
          (gpu.utilization === null ? '' : ` · ${gpu.utilization}% busy`)
      ])
    );
    const host = devices.host;
    const ranks = devices.ranks.map(rank =>
      h('div', 'jp-nbtrain-rank-memory', [
        `run ${rank.run} rank ${rank.rank} (pid ${rank.pid}): ${formatBytes(rank.rss)}` +
          (rank.gpu_memory === null ? '' : ` · GPU ${formatBytes(rank.gpu_memory)}`)
      ])
    );
    this.devicesNode.replaceChildren(
      ...(gpus.length ? gpus : [h('div', 'jp-nbtrain-device', ['No GPU (NVML finds none)'])]),
      h('div', 'jp-nbtrain-device jp-nbtrain-host', [
        `Host: ${plural(host.cpus, 'CPU')} · ${host.cpu_percent}% busy · memory ` +
          `${formatBytes(host.memory_used)} / ${formatBytes(host.memory_total)}`
      ]),
      ...ranks
    );
  }
}
