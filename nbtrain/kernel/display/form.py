"""``nbtrain.launcher()``: a form that sets the defaults of every ``%%distributed`` cell.

Core ipywidgets only (Dropdown, Combobox, IntSlider, Checkbox, BoundedFloatText,
BoundedIntText, HTML, VBox, HBox), so it renders wherever Jupyter widgets do: JupyterLab, Notebook 7, VS Code,
Kaggle (which loads no third-party widget JavaScript) and Colab (ipywidgets 7 as it is; 8 after
``google.colab.output.enable_custom_widget_manager()``).

What the machine offers is found without touching CUDA (GPUs through NVML, see
:mod:`nbtrain.hardware`), so the kernel can still fork healthy ranks afterwards. Every
change of a control becomes the session's defaults at once (through
:func:`nbtrain.kernel.defaults.set_defaults`), and the form shows the equivalent
``%%distributed`` line, to copy into a cell or another notebook. A flag written on a cell
still wins over the defaults.

Example (outside a notebook IPython prints the form's bundle; a notebook shows the form):
    >>> import nbtrain
    >>> form = nbtrain.launcher()  # doctest: +ELLIPSIS
    {'text/plain': 'nbtrain launcher: ...', ...}
    >>> form.accelerator.value = "cpu"
    >>> form.devices.value = 3  # a cell without flags now runs on 3 CPU processes
    >>> nbtrain.get_defaults().devices
    '3'
    >>> _ = nbtrain.reset_defaults()
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from nbtrain import config
from nbtrain.devices import GpuInfo
from nbtrain.errors import ConfigurationError
from nbtrain.kernel import defaults
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.display.show import enable_colab_widgets, show_widget
from nbtrain.options import LaunchOptions, devices_text

CPU_PROCESSES_PER_CORE = 2  # the slider goes up to twice the cores
DEFAULT_CPU_PROCESSES = 2
MAX_TIMEOUT_SECONDS = 30 * 24 * 3600.0
_ERROR_COLOUR = "#c62828"
_STYLE = {"description_width": "90px"}  # the controls' labels line up


@dataclass(frozen=True)
class Machine:
    """What this machine offers: its visible GPUs, whether MPS exists, its CPU cores."""

    gpus: tuple[GpuInfo, ...]
    mps: bool
    cpus: int

    @classmethod
    def probe(cls) -> Machine:
        """Ask NVML and the OS (never CUDA, never torch)."""
        from nbtrain import hardware

        return cls(tuple(hardware.detect_gpus()), hardware.mps_available(), hardware.cpu_count())

    def accelerators(self) -> list[tuple[str, str]]:
        """(label, value) of each accelerator found, the one ``auto`` picks first."""
        options = []
        if self.gpus:
            names = sorted({gpu.name for gpu in self.gpus})
            count = len(self.gpus)
            options.append((f"cuda: {count} GPU{'s' if count != 1 else ''} ({', '.join(names)})", "cuda"))
        if self.mps:
            options.append(("mps: the Apple GPU", "mps"))
        options.append((f"cpu: {self.cpus} core{'s' if self.cpus != 1 else ''}", "cpu"))
        return options


class LauncherForm:
    """The form. Its controls are attributes, so code can set them as a click would:

    - ``accelerator``: Dropdown of the accelerators found (``"cuda"``, ``"mps"``, ``"cpu"``);
    - ``devices``: IntSlider, the number of CPU processes (shown for ``cpu``);
    - ``gpus``: one Checkbox per GPU, with its name and free memory (shown for ``cuda``);
    - ``strategy``: Dropdown, with ``strategy_help`` under it saying when to use it;
    - ``timeout``: BoundedFloatText, seconds (0: no limit);
    - ``precision``: Dropdown of Lightning's precisions; ``backend``: Dropdown (``""``: gloo
      on CPU, nccl on CUDA); ``sync_batchnorm``: Checkbox;
    - ``cluster``: Combobox, ``local``, ``ray`` or a Ray address typed in; ``num_nodes``:
      BoundedIntText, the nodes a cluster run spans (1, and disabled, for ``local``);
    - ``magic_line``: HTML, the equivalent ``%%distributed`` line; ``status``: HTML, any problem.

    ``form`` is the ipywidgets box that is shown; ``settings`` the defaults it set.
    """

    def __init__(self, machine: Machine | None = None) -> None:
        import ipywidgets as widgets

        self.machine = machine or Machine.probe()
        current = defaults.get_defaults()
        wide = widgets.Layout(width="420px")  # one layout, shared by the full-width controls
        self._add_device_controls(widgets, current, wide)
        self._add_run_controls(widgets, current, wide)
        self._add_training_controls(widgets, current)
        self._add_cluster_controls(widgets, current)
        self.magic_line = widgets.HTML()
        self.status = widgets.HTML()
        title = widgets.HTML(
            "<b>nbtrain launcher</b>: the defaults of every <code>%%distributed</code> cell "
            "(a flag written on a cell still wins)"
        )
        self.form = widgets.VBox(
            [
                title,
                self.accelerator,
                self.devices_box,
                self.strategy,
                self.strategy_help,
                widgets.HBox([self.timeout, self.timeout_help]),
                widgets.HBox([self.precision, self.backend]),
                self.sync_batchnorm,
                widgets.HBox([self.cluster, self.num_nodes]),
                self.magic_line,
                self.status,
            ]
        )
        self.settings: LaunchOptions = current
        self._shown_in: Any = None
        controls = (self.accelerator, self.devices, self.strategy, self.timeout, *self.gpus)
        extra = (self.precision, self.backend, self.sync_batchnorm, self.cluster, self.num_nodes)
        for control in (*controls, *extra):
            control.observe(self._changed, names="value")
        self._changed()

    def _add_device_controls(self, widgets: Any, current: LaunchOptions, wide: Any) -> None:
        """The accelerator, the CPU processes and the GPUs, set as ``current`` says where this machine allows."""
        options = self.machine.accelerators()
        available = [value for _, value in options]
        accelerator = current.accelerator if current.accelerator in available else available[0]
        self.accelerator = widgets.Dropdown(
            options=options, value=accelerator, description="accelerator", style=_STYLE, layout=wide
        )
        top = max(DEFAULT_CPU_PROCESSES, self.machine.cpus * CPU_PROCESSES_PER_CORE)
        self.devices = widgets.IntSlider(
            value=min(top, _cpu_count_of(current, accelerator) or DEFAULT_CPU_PROCESSES),
            min=1,
            max=top,
            description="processes",
            style=_STYLE,
            layout=wide,
        )
        chosen = _gpus_of(current, self.machine.gpus)
        self.gpus = [
            widgets.Checkbox(value=gpu.index in chosen, description=f"GPU {gpu.describe()}", indent=False)
            for gpu in self.machine.gpus
        ]
        self.devices_help = widgets.HTML()
        self.devices_box = widgets.VBox()

    def _add_run_controls(self, widgets: Any, current: LaunchOptions, wide: Any) -> None:
        """The strategy and the timeout, set as ``current`` says."""
        strategy = current.strategy if current.strategy in config.STRATEGIES else "ddp_notebook"
        self.strategy = widgets.Dropdown(
            options=list(config.STRATEGIES), value=strategy, description="strategy", style=_STYLE, layout=wide
        )
        self.strategy_help = widgets.HTML()
        self.timeout = widgets.BoundedFloatText(
            value=current.timeout or 0.0,
            min=0.0,
            max=MAX_TIMEOUT_SECONDS,
            step=60.0,
            description="timeout (s)",
            style=_STYLE,
            layout=widgets.Layout(width="220px"),
        )
        self.timeout_help = widgets.HTML('<span style="color:#757575">0: no limit</span>')

    def _add_training_controls(self, widgets: Any, current: LaunchOptions) -> None:
        """Precision, process-group backend and BatchNorm sync, set as ``current`` says."""
        half = widgets.Layout(width="260px")
        self.precision = widgets.Dropdown(
            options=list(config.PRECISIONS), value=current.precision, description="precision", style=_STYLE,
            layout=half,
        )
        self.backend = widgets.Dropdown(
            options=[("default (gloo on CPU, nccl on CUDA)", ""), *((name, name) for name in config.BACKENDS)],
            value=current.backend or "", description="backend", layout=half,
        )
        self.sync_batchnorm = widgets.Checkbox(
            value=current.sync_batchnorm, description="sync BatchNorm statistics across ranks", indent=False
        )

    def _add_cluster_controls(self, widgets: Any, current: LaunchOptions) -> None:
        """Where the ranks run: this machine, or a Ray cluster's nodes (see docs/cluster.md)."""
        self.cluster = widgets.Combobox(
            options=["local", "ray"], value=current.cluster, placeholder="local, ray, or host:6379",
            description="cluster", ensure_option=False, style=_STYLE, layout=widgets.Layout(width="260px"),
        )
        self.num_nodes = widgets.BoundedIntText(
            value=current.num_nodes, min=1, max=1024, description="nodes", layout=widgets.Layout(width="160px"),
        )

    # -- reacting to the controls ------------------------------------------------------
    def _changed(self, _change: Any = None) -> None:
        accelerator = self.accelerator.value
        self._show_devices(accelerator)
        self.strategy_help.value = _help_html(config.STRATEGIES[self.strategy.value].when_to_use)
        cluster = self.cluster.value.strip() or "local"
        self.num_nodes.disabled = cluster == "local"
        try:
            self.settings = defaults.set_defaults(
                devices=self.devices_value(),
                accelerator=accelerator,
                strategy=self.strategy.value,
                timeout=self.timeout.value or None,
                precision=self.precision.value,
                backend=self.backend.value or None,
                sync_batchnorm=self.sync_batchnorm.value,
                cluster=cluster,
                num_nodes=1 if cluster == "local" else self.num_nodes.value,
            )
            self.status.value = ""
        except ConfigurationError as error:
            # The last good defaults stay; the line below shows them.
            self.status.value = f'<span style="color:{_ERROR_COLOUR}">{html.escape(str(error))}</span>'
        self.magic_line.value = (
            '<code style="user-select:all;white-space:pre">' + html.escape(self.settings.magic_line()) + "</code>"
        )

    def devices_value(self) -> str:
        """The ``--devices`` value the controls ask for."""
        accelerator = self.accelerator.value
        if accelerator == "cuda":
            chosen = [gpu.index for gpu, box in zip(self.machine.gpus, self.gpus, strict=True) if box.value]
            if not chosen:
                raise_no_gpu()
            if chosen == list(range(len(chosen))):
                return str(len(chosen))  # the first n GPUs: a count, as portable as it gets
            return devices_text(chosen)
        if accelerator == "mps":
            return "1"
        return str(self.devices.value)

    def _show_devices(self, accelerator: str) -> None:
        if accelerator == "cuda":
            self.devices_help.value = _help_html("one rank per checked GPU (free memory as NVML reports it now)")
            children = [self.devices_help, *self.gpus]
        elif accelerator == "mps":
            self.devices_help.value = _help_html("MPS is a single device: one rank")
            children = [self.devices_help]
        else:
            self.devices_help.value = _help_html(
                f"CPU processes (ranks) with gloo; this machine has {self.machine.cpus} "
                f"core{'s' if self.machine.cpus != 1 else ''}"
            )
            children = [self.devices, self.devices_help]
        if list(self.devices_box.children) != children:
            self.devices_box.children = children

    # -- showing ------------------------------------------------------------------------
    def show(self) -> LauncherForm:
        """Display the form in the current cell."""
        enable_colab_widgets()
        show_widget(self.form, self.summary())
        self._shown_in = kernel_shell.execution_count()
        return self

    def _ipython_display_(self) -> None:
        # ``nbtrain.launcher()`` as a cell's last line: it showed itself already.
        if self._shown_in is not None and self._shown_in == kernel_shell.execution_count():
            return
        self.show()

    def summary(self) -> str:
        """One line saying what the form set, for a saved notebook that cannot show the form."""
        return summary_line(self.settings)

    def __repr__(self) -> str:
        return f"<nbtrain launcher: {self.settings.magic_line()}>"


def summary_line(settings: LaunchOptions) -> str:
    """What a launcher form showing ``settings`` stands for, in one line.

    >>> summary_line(LaunchOptions("2", "cpu"))
    'nbtrain launcher: 2 x cpu, ddp_notebook, no timeout (the defaults of later %%distributed cells when it was shown)'
    """
    timeout = "no timeout" if settings.timeout is None else f"timeout {settings.timeout:g} s"
    return (
        f"nbtrain launcher: {settings.devices} x {settings.accelerator}, {settings.strategy}, {timeout}"
        " (the defaults of later %%distributed cells when it was shown)"
    )


def show_launcher_form(*, machine: Machine | None = None) -> LauncherForm:
    """Show the launcher form in this cell and return it (see :class:`LauncherForm`).

    Example:
        >>> import nbtrain
        >>> form = nbtrain.launcher()  # doctest: +ELLIPSIS
        {'text/plain': 'nbtrain launcher: ...', ...}
        >>> form.accelerator.value = "cpu"
        >>> form.devices.value = 4
        >>> nbtrain.get_defaults().magic_line()
        '%%distributed --devices 4 --accelerator cpu --strategy ddp_notebook'
        >>> _ = nbtrain.reset_defaults()
    """
    form = LauncherForm(machine)
    try:
        return form.show()
    except ImportError:  # no IPython: the form exists, nothing shows it
        return form


def raise_no_gpu() -> None:
    """Refuse a CUDA form with no GPU checked (a ConfigurationError saying what to do)."""
    raise ConfigurationError("no GPU is checked; check at least one, or choose the cpu accelerator.")


def _help_html(text: str) -> str:
    return f'<span style="color:#757575;margin-left:96px">{html.escape(text)}</span>'


def _cpu_count_of(current: LaunchOptions, accelerator: str) -> int | None:
    """The number of CPU processes the current defaults ask for, if they name one."""
    if accelerator != "cpu" or current.accelerator not in ("cpu", "auto"):
        return None
    text = current.devices.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _gpus_of(current: LaunchOptions, gpus: tuple[GpuInfo, ...]) -> set[int]:
    """The GPUs the current defaults select (all of them unless they say otherwise)."""
    visible = [gpu.index for gpu in gpus]
    text = current.devices.strip()
    if current.accelerator in ("cuda", "auto"):
        if "," in text:
            picked = {int(piece) for piece in text.split(",") if piece.strip().isdigit()}
            if picked and picked <= set(visible):
                return picked
        elif text.isdigit() and 0 < int(text) <= len(visible):
            return set(visible[: int(text)])
    return set(visible)
