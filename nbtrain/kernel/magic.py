"""``%%distributed``: run a notebook cell on N ranks and bring its results back into the kernel.

``%load_ext nbtrain`` registers it, and the same magic as ``%%nbtrain``, a name no other
package takes: where another extension (nbdistributed, torch-distdev) already holds
``%%distributed``, nbtrain leaves it theirs, says so in one line, and its cells are
``%%nbtrain`` cells (:func:`nbtrain.kernel.shell.magic_name` says which name is nbtrain's).
Then, with ``model``, ``opt`` and ``loader`` defined in earlier cells::

    %%distributed --devices 2
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()

trains data-parallel on two ranks, and afterwards the kernel's ``model`` (the same
object) holds rank 0's trained weights. This module owns the magic and its registration,
its flags come from :mod:`nbtrain.kernel.flags` (parsed once into a
:class:`~nbtrain.kernel.flags.CellOptions`, planned once into the launch config). Running
the cell is :mod:`nbtrain.kernel.cellrun`; what it writes in the cell is
:mod:`nbtrain.kernel.display`; a failure's wording is :mod:`nbtrain.kernel.tracebacks`.
What travels and what comes back is decided in :mod:`nbtrain.kernel.namespace`; what runs
on a rank is :mod:`nbtrain.rank.cell`.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nbtrain.errors import RankError
from nbtrain.kernel import cellrun, flags, importedmodules, launcher_connection, pdb_relay, standbyview
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.display import owntext
from nbtrain.kernel.flags import check_flags, help_text, parse_flags


@magics_class
class DistributedMagics(Magics):
    """The ``%%distributed`` cell magic, also registered as ``%%nbtrain`` (one method, two names)."""

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        # A name no other package registers: nbtrain's cells keep working whoever holds %%distributed.
        self.magics["cell"][kernel_shell.OWN_MAGIC] = _renamed(self.distributed, kernel_shell.OWN_MAGIC)

    @flags.flag_arguments
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on every rank, data-parallel, and bring rank 0's results back.

        The cell is plain single-device code: in auto mode (the default) the kernel's
        Modules, Optimizers and DataLoaders it uses are prepared on each rank (wrapped in
        DistributedDataParallel, sharded with FSDP2, given a DistributedSampler), and the
        loss passed to .backward() is logged. Code written for torchrun (its own
        init_process_group, DDP, DistributedSampler) runs unchanged; auto mode then
        steps aside. When the run ends, the kernel's models, optimizers and LR schedulers
        hold rank 0's final state (the same objects), and names the cell set are set in
        the kernel. Interrupt the kernel to stop every rank; nothing changes then.

        Strategies:
          ddp_notebook  data parallel; ranks fork from a warm, clean launcher (fast start)
          ddp_spawn     data parallel; each rank is a fresh interpreter (for libraries
                        that break after fork)
          ddp_find_unused_parameters_true
                        ddp_notebook for a model that skips some parameters in a step
                        (DDP then searches for them at every step, at some cost)
          ddp_sharded   data parallel, optimizer state partitioned across ranks (ZeRO)
          fsdp          fully sharded with FSDP2: each rank holds a slice of every weight
          fsdp_cpu_offload
                        fsdp with the shards and the optimizer step in host memory
          dp            DataParallel: one process splits each batch over the GPUs
                        (CUDA only; on CPU use ddp_notebook)
          auto          ddp_notebook for more than one device, a single worker for one

        Example (a DataLoader, model, loss_fn and opt defined in earlier cells):

            %%distributed --devices 2 --strategy ddp_notebook
            for x, y in loader:
                loss = loss_fn(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()

        Inside the cell (and functions it calls): nbtrain.rank(), nbtrain.world_size(),
        nbtrain.device(), nbtrain.log(loss=...), nbtrain.prepare(model, opt, loader).

        Defaults: a flag not given takes the session default, which
        nbtrain.set_defaults(devices=2, accelerator="cpu") or the form of
        nbtrain.launcher() set (built in: --devices auto --accelerator auto
        --strategy ddp_notebook, no timeout). A flag on the cell always wins.

        Background: with --background the cell returns at once with a handle
        (also in nbtrain.runs()); other cells run meanwhile. handle.wait() returns the
        cell's value or raises its failure, handle.stop() (or the view's Stop button)
        stops every rank. The kernel's objects keep their old values until the run
        finishes; then they are updated as above, between two cells (or in
        handle.wait()). Interrupting the kernel does not stop a background run.
        """
        return _run_cell(self.shell, self.distributed, line, cell)

    @line_magic
    def nbtrain_debug(self, line: str) -> None:
        """Open pdb in the frames of the rank kept after the last failed run (see docs/debugging.md).

        Commands are typed in the input box, as for %debug; q or c ends it and releases the rank.
        """
        nbtrain_debug()


# magic_arguments names every magic "%name" (its usage prefix adds one "%"); this one is a
# cell magic.
DistributedMagics.distributed.parser.prog = "%distributed"
DistributedMagics.distributed.__doc__ = DistributedMagics.distributed.__doc__.replace(
    "%distributed [", "%%distributed [", 1
)


def _run_cell(shell: Any, magic: Any, line: str, cell: str) -> Any:
    """The magic's one body, under either name: ``magic`` is the one the cell named (its parser and help)."""
    options = parse_flags(magic, line)
    if options.help:
        owntext.print_line(help_text(magic))
        return None
    return cellrun.run_distributed_cell(shell, line, cell, options, check_flags)


def _renamed(magic: Any, name: str) -> Any:
    """``magic`` (the bound ``distributed`` method) as cell magic ``%%name``: the same body and flags.

    Its own parser and docstring, so that ``%%name --help`` and ``%%name?`` show ``%%name``
    in the usage and the example, not ``%%distributed``.
    """

    def renamed(line: str, cell: str) -> Any:
        return _run_cell(magic.__self__.shell, renamed, line, cell)

    parser = copy.copy(magic.parser)  # the same flags (argparse's actions are shared, not copied)
    parser.prog = f"%{name}"  # the usage prefix adds the second "%"
    parser.description = parser.description.replace("%%distributed", f"%%{name}")
    renamed.parser = parser  # type: ignore[attr-defined]  # where magic_arguments keeps a magic's parser
    renamed.__doc__ = magic.__doc__.replace("%%distributed", f"%%{name}")
    renamed.__name__ = renamed.__qualname__ = name
    return renamed


def nbtrain_debug() -> None:
    """``%nbtrain_debug`` and ``nbtrain.debug()``: the post-mortem of the held rank, in this cell."""
    try:
        pdb_relay.post_mortem(launcher_connection.current_client())
    except pdb_relay.NoRankHeldError as error:
        raise UsageError(f"%nbtrain_debug: {error}") from None


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext nbtrain``: register ``%%nbtrain``, ``%%distributed`` where no other package holds it,
    and ``%debug`` after a rank's error."""
    # An instance, not the class: its table of names is its own, so %%distributed can be left out.
    magics = DistributedMagics(shell=ip)
    owner = kernel_shell.cell_magic_owner(ip, kernel_shell.SHARED_MAGIC)
    if kernel_shell.magic_for(owner) == f"%%{kernel_shell.OWN_MAGIC}":
        # Theirs stays: taking it would silently change what their users' cells do.
        del magics.magics["cell"][kernel_shell.SHARED_MAGIC]
        owntext.print_line(left_note(str(owner)))
    ip.register_magics(magics)
    _watch_standby_gpu_memory(ip, on=True)
    _watch_cell_imports(ip, on=True)
    original = ip.find_line_magic("debug")  # IPython's own, loaded (IPython 9 registers it lazily)
    if original is not None and not getattr(original, "nbtrain_wrapped", False):
        ip.register_magic_function(_debug_rank_first(original), "line", "debug")


def left_note(owner: str) -> str:
    """The one line ``%load_ext nbtrain`` shows where module ``owner``'s package holds ``%%distributed``.

    >>> left_note("nbdistributed.magic").split(";")[0]
    'nbtrain: %%distributed belongs to nbdistributed here (loaded before nbtrain), so nbtrain left it'
    """
    package = owner.split(".")[0]
    return (
        f"nbtrain: %%distributed belongs to {package} here (loaded before nbtrain), so nbtrain left it; "
        f"use %%{kernel_shell.OWN_MAGIC} for nbtrain's cells, with the same flags "
        f"(%%{kernel_shell.OWN_MAGIC} --devices 2; %%{kernel_shell.OWN_MAGIC} --help lists them)."
    )


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext nbtrain``: IPython's own ``%debug`` again (``%%distributed`` and ``%%nbtrain`` stay
    registered: IPython keeps no way to take a magic back)."""
    debug = ip.magics_manager.magics["line"].get("debug")
    original = getattr(debug, "__wrapped__", None) if getattr(debug, "nbtrain_wrapped", False) else None
    if original is not None:
        ip.magics_manager.magics["line"]["debug"] = original
    _watch_standby_gpu_memory(ip, on=False)
    _watch_cell_imports(ip, on=False)


def _watch_standby_gpu_memory(ip: Any, on: bool) -> None:
    """Before each cell the standby ranks give up GPU memory the cell may need; an out-of-memory error names them."""

    _watch(ip, on, standbyview.before_cell, standbyview.after_cell)


def _watch_cell_imports(ip: Any, on: bool) -> None:
    """What each cell imports: the ranks import it too, before its objects arrive (nbtrain.kernel.importedmodules)."""

    _watch(ip, on, importedmodules.CELLS.before_cell, importedmodules.CELLS.after_cell)


def _watch(ip: Any, on: bool, before: Any, after: Any) -> None:
    """Register (``on``) or unregister ``before``/``after`` as IPython's ``pre_run_cell``/``post_run_cell``."""
    for event, callback in (("pre_run_cell", before), ("post_run_cell", after)):
        registered = callback in ip.events.callbacks.get(event, [])
        if on and not registered:
            ip.events.register(event, callback)
        elif not on and registered:
            ip.events.unregister(event, callback)


def _debug_rank_first(original: Any) -> Any:
    """IPython's ``%debug`` right after a RankError whose rank is held: the rank's frames, not the kernel's."""

    def debug(line: str = "", local_ns: Any = None) -> Any:
        error = getattr(sys, "last_value", None)
        held = getattr(launcher_connection.current_client(), "held", None)
        if not line.strip() and isinstance(error, RankError) and held is not None and held.rank == error.rank:
            return nbtrain_debug()
        return original(line, local_ns=local_ns)

    debug.needs_local_scope = True  # type: ignore[attr-defined]  # IPython's flag, as on its own %debug
    debug.nbtrain_wrapped = True  # type: ignore[attr-defined]  # a second %load_ext does not wrap twice
    debug.__doc__ = original.__doc__
    debug.__wrapped__ = original  # type: ignore[attr-defined]  # what %unload_ext nbtrain puts back
    return debug
