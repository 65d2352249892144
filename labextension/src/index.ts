/**
 * nbtrain's JupyterLab (and Notebook 7) extension: a sidebar of every run and device,
 * a status-bar item ("nbtrain: 1 run · 2 ranks") and a command that inserts a
 * `%%distributed` cell (`%%nbtrain` where another package holds `%%distributed`) with the
 * kernel's session defaults. Its data come from nbtrain's
 * server extension (nbtrain/serverext), never from a kernel, so it keeps working while a
 * kernel is busy or after it died.
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { DEFAULTS_EXPRESSION, distributedCell, parsePythonString, statusText } from './model';
import { NbtrainPanel } from './panel';
import { RunsModel } from './runsmodel';

const STATUS_REFRESH_MS = 5000;
const DEFAULTS_TIMEOUT_MS = 3000;
export const INSERT_COMMAND = 'nbtrain:insert-distributed-cell';

const ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
<g class="jp-icon3" fill="#616161"><circle cx="5" cy="6" r="2.5"/><circle cx="5" cy="18" r="2.5"/>
<circle cx="19" cy="12" r="2.5"/><path d="M7 6.8l10 4.4v1.6L7 17.2v-1.7l8-3.5-8-3.5z"/></g></svg>`;

export const nbtrainIcon = new LabIcon({ name: 'nbtrain:icon', svgstr: ICON_SVG });

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'nbtrain:plugin',
  description: 'Every nbtrain run and device of this server in one sidebar, with Stop.',
  autoStart: true,
  optional: [ILabShell, IStatusBar, ICommandPalette, INotebookTracker],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    notebooks: INotebookTracker | null
  ) => {
    const model = new RunsModel();
    const panel = new NbtrainPanel(model, path => void app.commands.execute('docmanager:open', { path }));
    panel.title.icon = nbtrainIcon;
    app.shell.add(panel, 'right', { rank: 900 });
    if (statusBar) {
      addStatusItem(app, statusBar, model, panel);
    }
    if (notebooks) {
      addInsertCommand(app, notebooks, palette);
    }
  }
};

function addStatusItem(app: JupyterFrontEnd, statusBar: IStatusBar, model: RunsModel, panel: Widget): void {
  const item = new Widget();
  item.addClass('jp-nbtrain-status');
  item.node.title = 'nbtrain runs: click to show them';
  item.node.addEventListener('click', () => app.shell.activateById(panel.id));
  model.changed.connect(() => {
    item.node.textContent = statusText(model.runs);
  });
  statusBar.registerStatusItem('nbtrain:status', {
    item,
    align: 'left',
    rank: 900,
    isActive: () => true
  });
  // The status bar is always on screen: a slower poll, and none while the browser tab is hidden.
  void model.refresh();
  window.setInterval(() => {
    if (!document.hidden && !panel.isVisible) {
      void model.refresh();
    }
  }, STATUS_REFRESH_MS);
}

function addInsertCommand(app: JupyterFrontEnd, notebooks: INotebookTracker, palette: ICommandPalette | null): void {
  app.commands.addCommand(INSERT_COMMAND, {
    label: 'Insert an nbtrain cell (session defaults)',
    caption: "A new cell below with the kernel's nbtrain defaults (nbtrain.get_defaults()) as flags",
    isEnabled: () => notebooks.currentWidget !== null,
    execute: async () => {
      const current = notebooks.currentWidget;
      if (!current) {
        return;
      }
      const line = await kernelDefaults(current.sessionContext.session?.kernel ?? null);
      NotebookActions.insertBelow(current.content);
      current.content.activeCell?.model.sharedModel.setSource(distributedCell(line));
    }
  });
  palette?.addItem({ command: INSERT_COMMAND, category: 'nbtrain' });
}

/** The kernel's `%%distributed` (or `%%nbtrain`) line for its defaults, or '' if it does not answer in time (busy). */
async function kernelDefaults(kernel: any): Promise<string> {
  if (!kernel) {
    return '';
  }
  const future = kernel.requestExecute({
    code: '',
    silent: true,
    store_history: false,
    user_expressions: { defaults: DEFAULTS_EXPRESSION }
  });
  let timer: number | undefined;
  const timeout = new Promise<null>(resolve => {
    timer = window.setTimeout(() => resolve(null), DEFAULTS_TIMEOUT_MS);
  });
  try {
    const reply: any = await Promise.race([future.done, timeout]);
    const result = reply?.content?.user_expressions?.defaults;
    return result?.status === 'ok' ? parsePythonString(result.data?.['text/plain']) : '';
  } catch {
    return '';
  } finally {
    window.clearTimeout(timer);
  }
}

export default plugin;
