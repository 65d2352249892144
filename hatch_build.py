"""Builds nbtrain's JupyterLab extension (labextension/ -> nbtrain/labextension/) when it is missing.

The wheel ships the built extension (shared-data in pyproject.toml), so users never need
Node. Building it takes npm (against the npm registry, with labextension/package-lock.json)
and jupyterlab's `jupyter labextension build`; both are asked for only when the built
extension is missing: a rebuild of an editable install that already has it (`.ci/setup`)
installs nothing more and runs no npm. `NBTRAIN_SKIP_LABEXTENSION=1` skips the build (the
package then has no sidebar; everything else works). Delete nbtrain/labextension/ to rebuild.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "labextension"
TARGETS = ("nbtrain/labextension/package.json", "nbtrain/labextension/static/style.js")
# jupyterlab builds with the core packages of labextension/package-lock.json (4.6.x).
BUILD_REQUIRES = ["hatch-jupyter-builder>=0.9", "jupyterlab>=4.6,<4.7"]


class LabExtensionBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def _needed(self) -> bool:
        if os.environ.get("NBTRAIN_SKIP_LABEXTENSION") == "1" or self.target_name == "sdist":
            return False
        return not all((Path(self.root) / target).exists() for target in TARGETS)

    def dependencies(self) -> list[str]:
        return BUILD_REQUIRES if self._needed() else []

    def initialize(self, version: str, build_data: dict) -> None:
        if not self._needed():
            return
        if shutil.which("npm") is None:
            raise RuntimeError(
                "nbtrain: building the JupyterLab extension from labextension/ needs Node.js and npm, "
                "and `npm` is not on PATH. Install them (Debian/Ubuntu: apt-get install nodejs npm; "
                ".ci/setup does this), or set NBTRAIN_SKIP_LABEXTENSION=1 to install without the sidebar."
            )
        from hatch_jupyter_builder import npm_builder

        source = Path(self.root) / SOURCE
        if not (source / "node_modules").exists():
            # npm ci: exactly the versions of package-lock.json, from the npm registry.
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=source, check=True)
        npm_builder(self.target_name, version, path=str(source), build_cmd="build:prod", npm=["npm"])
        missing = [target for target in TARGETS if not (Path(self.root) / target).exists()]
        if missing:
            raise RuntimeError(f"nbtrain: the JupyterLab extension build ran but did not write {missing}")
