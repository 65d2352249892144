"""``nbtrain.launcher()``: a form that sets the defaults of every ``%%distributed`` cell.

Core ipywidgets only (Dropdown, Combobox, IntSlider, Checkbox, BoundedFloatText,
BoundedIntText, HTML, VBox, HBox), so it renders wherever Jupyter widgets do: JupyterLab, Notebook 7, VS Code,
Kaggle (which loads no third-party widget JavaScript) and Colab (ipywidgets 7 as it is; 8 after
``google.colab.output.enable_custom_widget_manager()``).

What the machine offers is found without touching CUDA (GPUs through NVML, see
:mod:`nbtrain.planning.probe`), so the kernel can still fork healthy ranks afterwards. Every
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbtrain import options as options_module
from nbtrain.errors import ConfigurationError
from nbtrain.kernel import defaults
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.display.show import enable_colab_widgets, show_widget
from nbtrain.options import LaunchOptions, Option, devices_text
from nbtrain.planning import probe
from nbtrain.planning.deviceplan import GpuInfo

CPU_PROCESSES_PER_CORE = 2  # the slider goes up to twice the cores
DEFAULT_CPU_PROCESSES = 2
MAX_TIMEOUT_SECONDS = 30 * 24 * 3600.0
MAX_COUNT = 1024  # a count control's top (nodes)
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

        return cls(tuple(probe.detect_gpus()), probe.mps_available(), probe.cpu_count())

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
    - then one control per launch option whose ``Option.control`` says how to show it
      (:mod:`nbtrain.options`), named as the option: ``strategy`` (Dropdown, with
      ``strategy_help`` under it saying when to use it), ``timeout`` (seconds, 0: no limit),
      ``precision`` and ``backend`` (Dropdowns; ``""``: gloo on CPU, nccl on CUDA),
      ``sync_batchnorm`` (Checkbox), ``cluster`` (Combobox: ``local``, ``ray`` or a Ray
      address typed in) and ``num_nodes`` (the nodes a cluster run spans: 1, and disabled,
      for ``local``); a new option with a control appears without a change here;
    - ``magic_line``: HTML, the equivalent ``%%distributed`` line (``%%nbtrain`` where another package
      holds ``%%distributed``); ``status``: HTML, any problem.

    ``form`` is the ipywidgets box that is shown; ``settings`` the defaults it set;
    ``controls`` the options' controls by option name.
    """

    def __init__(self, machine: Machine | None = None) -> None:
        # deferred: start-up time (ipywidgets)
        import ipywidgets as widgets

        self.machine = machine or Machine.probe()
        current = defaults.get_defaults()
        self._add_device_controls(widgets, current, widgets.Layout(width="420px"))
        self.controls: dict[str, Any] = {}
        self._explained: dict[str, tuple[Any, Mapping[str, str]]] = {}  # name -> (its help, value -> text)
        rows = self._add_option_controls(widgets, current)
        self.__dict__.update({**self.controls, **self.helps})  # form.precision, form.strategy_help
        self.magic_line = widgets.HTML()
        self.status = widgets.HTML()
        title = widgets.HTML(
            f"<b>nbtrain launcher</b>: the defaults of every <code>{kernel_shell.magic_name()}</code> cell "
            "(a flag written on a cell still wins)"
        )
        self.form = widgets.VBox([title, self.accelerator, self.devices_box, *rows, self.magic_line, self.status])
        self.settings: LaunchOptions = current
        self._shown_in: Any = None
        for control in (self.accelerator, self.devices, *self.gpus, *self.controls.values()):
            control.observe(self._changed, names="value")
        self._changed()

    def _add_device_controls(self, widgets: Any, current: LaunchOptions, wide: Any) -> None:
        """The accelerator, the CPU processes and the GPUs, set as ``current`` says where this machine allows."""
        options = self.machine.accelerators()
        available = [value for _, value in options]
        accelerator = current.accelerator if current.accelerator in available else available[0]
        look = {"style": _STYLE, "layout": wide}
        self.accelerator = widgets.Dropdown(options=options, value=accelerator, description="accelerator", **look)
        top = max(DEFAULT_CPU_PROCESSES, self.machine.cpus * CPU_PROCESSES_PER_CORE)
        processes = min(top, _cpu_count_of(current, accelerator) or DEFAULT_CPU_PROCESSES)
        self.devices = widgets.IntSlider(value=processes, min=1, max=top, description="processes", **look)
        chosen = _gpus_of(current, self.machine.gpus)
        self.gpus = [
            widgets.Checkbox(value=gpu.index in chosen, description=f"GPU {gpu.describe()}", indent=False)
            for gpu in self.machine.gpus
        ]
        self.devices_help = widgets.HTML()
        self.devices_box = widgets.VBox()

    def _add_option_controls(self, widgets: Any, current: LaunchOptions) -> list[Any]:
        """A control per option that has one (``Option.control``), set as ``current`` says: the form's rows."""
        self.helps: dict[str, Any] = {}  # "strategy_help": the grey text beside or under a control
        rows: dict[int, list[Any]] = {}
        under: dict[int, list[Any]] = {}  # what each row explains under it
        for name, info in options_module.described():
            shown = info.control
            if shown is None:
                continue
            first = shown.row not in rows  # the row's first control: its label lines up with the others'
            control = self.controls[name] = _control(widgets, name, info, getattr(current, name), first)
            rows.setdefault(shown.row, []).append(control)
            if shown.note:
                note = self.helps[f"{name}_help"] = widgets.HTML(_note_html(shown.note))
                rows[shown.row].append(note)
            if shown.explain is not None:
                help_ = self.helps[f"{name}_help"] = widgets.HTML()
                self._explained[name] = (help_, shown.explain)
                under.setdefault(shown.row, []).append(help_)
        laid: list[Any] = []
        for number, row in sorted(rows.items()):
            laid += [row[0] if len(row) == 1 else widgets.HBox(row), *under.get(number, [])]
        return laid

    # -- reacting to the controls ------------------------------------------------------
    def _changed(self, _change: Any = None) -> None:
        accelerator = self.accelerator.value
        self._show_devices(accelerator)
        for name, (shown, meanings) in self._explained.items():
            shown.value = _help_html(meanings.get(self.controls[name].value, ""))
        chosen = {name: self.option_value(name) for name in self.controls}
        local = chosen.get("cluster", "local") == "local"
        if "num_nodes" in self.controls:  # the nodes go with a cluster: one here
            self.controls["num_nodes"].disabled = local
            chosen["num_nodes"] = 1 if local else chosen["num_nodes"]
        try:
            self.settings = defaults.set_defaults(devices=self.devices_value(), accelerator=accelerator, **chosen)
            self.status.value = ""
        except ConfigurationError as error:
            # The last good defaults stay; the line below shows them.
            self.status.value = f'<span style="color:{_ERROR_COLOUR}">{html.escape(str(error))}</span>'
        line = html.escape(self.settings.magic_line())
        self.magic_line.value = f'<code style="user-select:all;white-space:pre">{line}</code>'

    def option_value(self, name: str) -> Any:
        """The value option ``name``'s control asks for (an empty control: the option's ``Control.empty``)."""
        value = self.controls[name].value
        if isinstance(value, str):
            value = value.strip()
        if isinstance(value, bool) or value not in ("", 0):
            return value
        return _CONTROLS[name].empty

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
        return "1" if accelerator == "mps" else str(self.devices.value)

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
        show_widget(self.form, summary_line(self.settings))
        self._shown_in = kernel_shell.execution_count()
        return self

    def _ipython_display_(self) -> None:
        # ``nbtrain.launcher()`` as a cell's last line: it showed itself already.
        if self._shown_in is not None and self._shown_in == kernel_shell.execution_count():
            return
        self.show()

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
        f" (the defaults of later {kernel_shell.magic_name()} cells when it was shown)"
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


_CONTROLS = {name: info.control for name, info in options_module.described() if info.control is not None}


def _control(widgets: Any, name: str, info: Option, value: Any, first: bool) -> Any:
    """The ipywidgets control showing option ``name`` at ``value``, as its ``Option.control`` says."""
    shown = _CONTROLS[name]
    kind = shown.kind or ("checkbox" if isinstance(value, bool) else "dropdown" if info.choices else "combobox")
    label = shown.label or name
    look: dict[str, Any] = {"layout": widgets.Layout(width=f"{shown.width}px")} if shown.width else {}
    if kind == "checkbox":
        return widgets.Checkbox(value=bool(value), description=label, indent=False, **look)
    if first:
        look["style"] = _STYLE
    if kind == "seconds":
        return widgets.BoundedFloatText(
            value=value or 0.0, min=0.0, max=MAX_TIMEOUT_SECONDS, step=60.0, description=label, **look
        )
    if kind == "count":
        return widgets.BoundedIntText(value=value or 1, min=1, max=MAX_COUNT, description=label, **look)
    pairs = [each if isinstance(each, tuple) else (str(each), each) for each in shown.choices or info.choices or ()]
    text = "" if value is None else value
    if kind == "combobox":
        return widgets.Combobox(
            options=[each for _, each in pairs], value=str(text), placeholder=shown.placeholder,
            description=label, ensure_option=False, **look,
        )
    values = [each for _, each in pairs]
    given = list(shown.choices or info.choices or ())
    options = pairs if any(isinstance(each, tuple) for each in given) else given  # ipywidgets takes either, not both
    return widgets.Dropdown(options=options, value=text if text in values else values[0], description=label, **look)


def _note_html(text: str) -> str:
    return f'<span style="color:#757575">{html.escape(text)}</span>'
