import { test } from 'node:test';
import * as assert from 'node:assert/strict';

import {
  actionFor,
  distributedCell,
  formatBytes,
  formatElapsed,
  formatLoss,
  heldText,
  parsePythonString,
  runTitle,
  sharedHostText,
  sparklinePoints,
  stateText,
  statusText
} from '../src/model';

test('what other users could reach is said once above the runs, each sentence once', () => {
  const nccl = 'nbtrain: this machine has 3 user accounts, and ... NCCL ...';
  const off = 'nbtrain: this machine has 3 user accounts, and ... NBTRAIN_PRIVATE_NETWORK=0 ...';
  assert.equal(sharedHostText([{ shared_host: nccl }, { shared_host: null }, {}, { shared_host: nccl }]), nccl);
  assert.equal(sharedHostText([{ shared_host: nccl }, { shared_host: off }]), `${nccl} ${off}`);
  assert.equal(sharedHostText([{ shared_host: null }, {}]), '');
  assert.equal(sharedHostText([]), '');
});

test('a stop that kept its step says which', () => {
  assert.equal(stateText({ state: 'stopped', stopped_at: 412 }), 'stopped at step 412');
  assert.equal(stateText({ state: 'timed out', stopped_at: 3 }), 'timed out at step 3');
  assert.equal(stateText({ state: 'stopped', stopped_at: null }), 'stopped');
  assert.equal(stateText({ state: 'running' }), 'running');
});

test('a failed run names the rank it holds, and its Dismiss releases it', () => {
  const held = 'rank 1 (pid 4242) kept for %nbtrain_debug, holding 244 MiB of host memory';
  const run = { state: 'failed', held };
  assert.equal(
    heldText(run),
    'Held: rank 1 (pid 4242) kept for %nbtrain_debug, holding 244 MiB of host memory. ' +
      '%nbtrain_debug opens it; Dismiss releases it.'
  );
  const dismiss = actionFor(run);
  assert.equal(dismiss.label, 'Dismiss');
  assert.equal(dismiss.action, 'clean');
  assert.match(dismiss.hint, /^Release the rank held for %nbtrain_debug/);
  // Released (the launcher clears the field), or never held: no line, a plain Dismiss.
  assert.equal(heldText({ held: null }), '');
  assert.equal(heldText({}), '');
  assert.equal(actionFor({ state: 'failed', held: null }).hint, 'Forget this ended run');
});

test('the button stops a run going, cleans up an orphan, dismisses an ended run', () => {
  assert.deepEqual(
    [actionFor({ state: 'running' }), actionFor({ state: 'starting' })].map(a => [a.label, a.action]),
    [['Stop', 'stop'], ['Stop', 'stop']]
  );
  assert.equal(actionFor({ state: 'orphaned' }).label, 'Clean up');
  assert.equal(actionFor({ state: 'stopped' }).label, 'Dismiss');
  assert.equal(actionFor({ state: 'stopping' }).action, 'clean'); // disabled while stopping
});

test('status text counts active runs and their ranks', () => {
  assert.equal(statusText([{ state: 'running', world_size: 2 }]), 'nbtrain: 1 run · 2 ranks');
  assert.equal(
    statusText([
      { state: 'running', world_size: 2 },
      { state: 'stopping', world_size: 4 },
      { state: 'finished', world_size: 8 },
      { state: 'orphaned', world_size: 3 }
    ]),
    'nbtrain: 2 runs · 6 ranks'
  );
  assert.equal(statusText([{ state: 'running', world_size: 1 }]), 'nbtrain: 1 run · 1 rank');
  assert.equal(statusText([{ state: 'finished', world_size: 2 }]), '');
});

test('elapsed time reads as m:ss or h:mm:ss', () => {
  assert.equal(formatElapsed(0), '0:00');
  assert.equal(formatElapsed(75.9), '1:15');
  assert.equal(formatElapsed(3725), '1:02:05');
  assert.equal(formatElapsed(-3), '0:00');
});

test('bytes, losses', () => {
  assert.equal(formatBytes(512), '512 B');
  assert.equal(formatBytes(1536), '1.5 KiB');
  assert.equal(formatBytes(3 * 1024 ** 3), '3.0 GiB');
  assert.equal(formatBytes(null), '–');
  assert.equal(formatLoss(0.123456), '0.123');
  assert.equal(formatLoss(1234.5), '1230');
  assert.equal(formatLoss(null), '–');
  assert.equal(formatLoss(NaN), '–');
});

test('sparkline puts the highest loss at the top and spans the width', () => {
  assert.equal(sparklinePoints([2, 1, 0], 100, 20), '0,0 50,10 100,20');
  assert.equal(sparklinePoints([5, 5], 10, 20), '0,10 10,10');
  assert.equal(sparklinePoints([1], 10, 20), '');
  assert.equal(sparklinePoints([1, NaN, 3], 10, 20), '0,20 10,0');
});

test('a run is named by its notebook, else its kernel', () => {
  assert.equal(runTitle({ id: 'a-1', notebook: 'dir/train.ipynb', kernel_id: 'k' }), 'train.ipynb');
  assert.equal(runTitle({ id: 'a-1', notebook: null, kernel_id: '0123456789' }), 'kernel 01234567');
  assert.equal(runTitle({ id: 'a-1' }), 'run a-1');
});

test('the inserted cell uses the kernel defaults, or a plain %%nbtrain', () => {
  const line = parsePythonString("'%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook'");
  assert.equal(line, '%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook');
  assert.equal(distributedCell(line), line + '\n');
  // where another package holds %%distributed, the kernel's line starts with %%nbtrain
  assert.equal(distributedCell('%%nbtrain --devices 2 --accelerator cpu'), '%%nbtrain --devices 2 --accelerator cpu\n');
  assert.equal(distributedCell(parsePythonString("''")), '%%nbtrain\n');
  assert.equal(distributedCell(undefined), '%%nbtrain\n');
  assert.equal(distributedCell('print(1)'), '%%nbtrain\n');
  assert.equal(distributedCell('%%distributedx'), '%%nbtrain\n');
});
