"""The IPython shell as the kernel side sees it (nbtrain.kernel.shell).

A real IPython shell is made in a child interpreter (a shell is a process-wide singleton;
this test process must stay without one), running cells as a kernel would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from nbtrain.kernel import shell
from nbtrain.system import processes

CHILD_SECONDS = 120.0


def in_a_shell(cells: list[str]) -> dict:
    """Run ``cells`` one by one in a fresh IPython shell; the last cell prints a JSON report."""
    code = textwrap.dedent(
        f"""
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        for cell in {cells!r}:
            result = ip.run_cell(cell, store_history=True)
            if not result.success:
                raise SystemExit(f"cell failed: {{result.error_in_exec or result.error_before_exec}}")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_SECONDS, check=False
    )
    assert out.returncode == 0, out.stderr + out.stdout
    # The last JSON line: an extension may display something after each cell (nbdistributed does).
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


ASK_THE_SHELL = """
from nbtrain.kernel import shell as s
me = s.get_shell()
number = s.current_cell_number(me)
"""
REPORT = """
import json
print(json.dumps({
    'number': number, 'x': s.user_namespace(me)['x'], 'hidden': 'In' in s.hidden_names(me),
    'notebook': s.is_notebook(me), 'loop': s.kernel_loop(me),
}))
"""


def test_a_shell_gives_its_cell_number_and_namespace():
    report = in_a_shell(["x = 1", ASK_THE_SHELL, REPORT])
    assert report == {
        "number": 2,
        "x": 1,
        "hidden": True,
        "notebook": False,  # a terminal shell: no HTML, no widgets
        "loop": None,
    }


def test_without_a_shell_there_is_nothing_to_ask():
    code = "from nbtrain.kernel import shell as s; import sys; "
    code += "print(s.get_shell(), s.execution_count(), 'IPython' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_SECONDS, check=True
    )
    assert out.stdout == "None None False\n"  # and IPython was not imported to find out


def test_the_kernels_loop_is_found_on_its_shell():
    class Loop:
        def add_callback(self, callback: object) -> None:
            pass

    class Kernel:
        io_loop = Loop()

    class Shell:
        kernel = Kernel()

    assert shell.kernel_loop(Shell()) is Kernel.io_loop


def test_an_interrupt_during_a_deferred_block_comes_after_the_block():
    done = []
    with pytest.raises(KeyboardInterrupt), shell.interrupts_deferred():
        signal.raise_signal(signal.SIGINT)
        done.append("the whole update")
    assert done == ["the whole update"]
    with shell.interrupts_deferred():
        pass  # no interrupt: nothing raised
    # Inside a section that holds them, that section acts.
    with processes.interrupts_held() as outer, shell.interrupts_deferred():
        signal.raise_signal(signal.SIGINT)
    assert outer.received


def test_the_magic_is_distributed_unless_another_package_holds_that_name():
    assert shell.magic_for(None) == "%%distributed"  # no one holds it: nbtrain takes it as it loads
    assert shell.magic_for(shell.MAGICS_MODULE) == "%%distributed"
    assert shell.magic_for("nbdistributed.magic") == "%%nbtrain"
    assert shell.magic_for("torch_distdev.magics") == "%%nbtrain"
    assert shell.MAGICS_MODULE == "nbtrain.kernel.magic"  # where DistributedMagics is written
    assert shell.is_nbtrain_cell("  %%nbtrain --devices 2\nx = 1") and not shell.is_nbtrain_cell("%%nbtrainer\n")
    assert shell.is_nbtrain_cell("%%distributed\nx = 1")  # no shell here: %%distributed is nbtrain's


# nbtrain's registration alone (no launcher is warmed), beside nbdistributed's extension.
LOAD_NBTRAIN = "from nbtrain.kernel import magic as m; m.load_ipython_extension(ip)"
LOAD_THEIRS = "import nbdistributed; nbdistributed.load_ipython_extension(ip)"
WHO_HOLDS = """
import json
from nbtrain.kernel import shell as s
me = s.get_shell()
print(json.dumps({
    'distributed': s.cell_magic_owner(me, 'distributed'), 'nbtrain': s.cell_magic_owner(me, 'nbtrain'),
    'rank': s.cell_magic_owner(me, 'rank'), 'name': s.magic_name(),
    'theirs_is_nbtrains': s.is_nbtrain_cell('%%distributed\\nx = 1'),
}))
"""


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ([], {"distributed": None, "nbtrain": None, "rank": None, "name": "%%distributed"}),
        ([LOAD_NBTRAIN], {"distributed": "nbtrain.kernel.magic", "nbtrain": "nbtrain.kernel.magic", "rank": None,
                          "name": "%%distributed"}),
        ([LOAD_THEIRS, LOAD_NBTRAIN], {"distributed": "nbdistributed.magic", "nbtrain": "nbtrain.kernel.magic",
                                       "rank": "nbdistributed.magic", "name": "%%nbtrain"}),
        ([LOAD_NBTRAIN, LOAD_THEIRS], {"distributed": "nbdistributed.magic", "nbtrain": "nbtrain.kernel.magic",
                                       "rank": "nbdistributed.magic", "name": "%%nbtrain"}),
    ],
    ids=["nothing loaded", "nbtrain alone", "nbdistributed first", "nbdistributed after"],
)
def test_the_magic_that_is_nbtrains_follows_who_holds_distributed(order, expected):
    report = in_a_shell(["ip = get_ipython()", *order, WHO_HOLDS])
    assert report == {**expected, "theirs_is_nbtrains": expected["name"] == "%%distributed"}
