"""Cell naming (nbtrain.kernel.cellnames): cells registered for tracebacks, named ``Cell In[N]``.

A real IPython shell runs in a child interpreter (a shell is a process-wide singleton;
this test process stays without one); a rank's traceback naming the cell is
tests/test_tracebacks.py, in a real kernel.
"""

from __future__ import annotations

import json
import linecache
import subprocess
import sys
import textwrap

from nbtrain.kernel import cellnames

CHILD_SECONDS = 120.0

IN_A_SHELL = textwrap.dedent(
    """
    import json, linecache
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    ip.run_cell("x = 1", store_history=True)
    ip.run_cell(
        "from nbtrain.kernel import cellnames\\n"
        "name = cellnames.register_source(get_ipython(), '--devices 2', 'y = 2\\\\n')",
        store_history=True,
    )
    name, cellnames = ip.user_ns["name"], ip.user_ns["cellnames"]
    namer = cellnames.cell_namer(ip)
    print(json.dumps({
        "lines": [linecache.getline(name, 1), linecache.getline(name, 2)],
        "named": namer(name), "other": namer("/elsewhere.py"),
        "text": cellnames.name_cells(f'> {name}(2)<module>()', ip),
    }))
    """
)


def test_a_cell_registered_in_a_shell_is_named_after_its_number():
    out = subprocess.run(
        [sys.executable, "-c", IN_A_SHELL], capture_output=True, text=True, timeout=CHILD_SECONDS, check=False
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {
        "lines": ["%%distributed --devices 2\n", "y = 2\n"],  # as the user wrote it: line 1 is the magic's
        "named": "Cell In[2]",
        "other": None,
        "text": "> Cell In[2](2)<module>()",
    }


def test_source_registered_without_a_shell_is_in_linecache_under_a_name_of_its_own():
    name = cellnames.register_source(None, "", "total = 0\ntotal += 1\n")
    try:
        assert name.startswith("<cell-") and linecache.getline(name, 3) == "total += 1\n"
        assert linecache.getline(name, 1) == "%%distributed\n"
        assert cellnames.cell_namer(None)(name) is None  # no shell, no cell numbers
    finally:
        linecache.cache.pop(name, None)
