/** The runs the sidebar and the status bar show, fetched from the server on demand. */
import { ISignal, Signal } from '@lumino/signaling';

import { fetchRuns } from './api';
import { RunInfo } from './model';

export class RunsModel {
  runs: RunInfo[] = [];
  error = '';
  private readonly _changed = new Signal<this, void>(this);
  private pending: Promise<void> | null = null;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Ask the server (one request at a time; callers meanwhile share it). */
  refresh(): Promise<void> {
    if (!this.pending) {
      this.pending = this.load().finally(() => {
        this.pending = null;
      });
    }
    return this.pending;
  }

  private async load(): Promise<void> {
    try {
      this.runs = await fetchRuns();
      this.error = '';
    } catch (error) {
      this.error = `nbtrain could not list the runs: ${error}`;
    }
    this._changed.emit();
  }
}
