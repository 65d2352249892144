/** Calls to nbtrain's server extension, through Jupyter's own connection (token and XSRF). */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { DevicesInfo, RunInfo } from './model';

async function request<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'nbtrain', 'api', path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  let data: any = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = { message: text };
  }
  if (!response.ok && !(data && data.refused)) {
    throw new Error((data && (data.message || data.reason)) || `${response.status} ${response.statusText}`);
  }
  return data as T;
}

export function fetchRuns(): Promise<RunInfo[]> {
  return request<RunInfo[]>('runs');
}

export function fetchDevices(): Promise<DevicesInfo> {
  return request<DevicesInfo>('devices');
}

export interface ActionOutcome {
  id: string;
  signalled: number[];
  refused: number[];
  message: string;
}

/** `stop`: signal the run's ranks; `clean`: forget an ended or orphaned run, killing what is left. */
export function runAction(id: string, action: 'stop' | 'clean'): Promise<ActionOutcome> {
  return request<ActionOutcome>(`runs/${encodeURIComponent(id)}/${action}`, { method: 'POST' });
}
