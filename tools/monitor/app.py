"""The monitor: poll the devices, render a dashboard, repeat.

    DeviceSet.poll() ──▶ [DeviceView] ──▶ dashboard() / dashboard_grid() ──▶ rich Live or stdout
         ▲ every --interval s                       ▲ keys: ←/→ device, space pause, q quit

`Monitor.run_frames(n)` prints n frames one after another and returns (scripts, tests, CI logs);
`Monitor.run_live()` redraws in place until 'q' or Ctrl-C.
"""
from __future__ import annotations

import itertools
import time
from datetime import datetime

from rich.console import Console, Group, RenderableType
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from emulator import device as dev
from tools.monitor import panels as P
from tools.monitor.keys import KeyReader
from tools.monitor.source import DeviceSet, DeviceView

KEYS_HELP = "←/→ device · space pause · q quit"


def header(views: list[DeviceView], selected: int, clock: str, *, paused: bool = False,
           interactive: bool = False) -> Text:
    """One line: the selected device and its state, the wall clock, the keys."""
    text = Text("cxlemu monitor", style="bold")
    if views:
        view = views[selected]
        text.append(f"  {view.name}: ")
        text.append(view.state, style=P.STATE_STYLE[view.state])
        if view.detail:
            text.append(f" ({view.detail})")
    text.append(f"  {clock}")
    if paused:
        text.append("  PAUSED", style="reverse")
    if interactive:
        text.append(f"  [{KEYS_HELP}]", style="dim")
    return text


def _no_devices() -> Panel:
    return Panel(Text(f"no devices in {dev.runtime_dir()} (serve one with `cxlemu serve --name NAME --capacity SIZE`)"),
                 title="devices")


def _absent(view: DeviceView) -> Panel:
    """In place of the detail panels for a device never seen: what is missing and where."""
    return Panel(Text(f"{view.name} is {view.state}: {view.detail}; waiting for it to appear"),
                 title=view.name)


def _spark_width(width: int) -> int:
    """Sparkline cells that fit a half-width panel of a `width`-column screen."""
    return max(10, width // 2 - 12)


def _heat_width(width: int) -> int:
    """Heat-map cells per row: the full width inside the panel's border and padding."""
    return max(16, width - 4)


def dashboard_grid(views: list[DeviceView], selected: int, now: float, clock: str,
                   width: int = 120) -> RenderableType:
    """The dashboard at its natural height for a `width`-column screen, for printing frames one
    after another."""
    if not views:
        return Group(header(views, 0, clock), _no_devices())
    view = views[selected]
    devices = Panel(Group(P.device_table(views, selected), P.notes_line(view)), title="devices")
    if view.snapshot is None:
        return Group(header(views, selected, clock), devices, _absent(view))
    cols = Table.grid(expand=True)
    cols.add_column(ratio=1)
    cols.add_column(ratio=1)
    cols.add_row(Group(P.capacity_panel(view), P.bandwidth_panel(view, now, _spark_width(width)),
                       P.latency_panel(view)),
                 Group(P.kv_panel(view), P.queue_panel(view), P.events_panel(view)))
    hosts = [P.hosts_panel(view)] if P.pool_of(view) is not None else []
    return Group(header(views, selected, clock), devices, cols, *hosts, P.heatmap_panel(view, _heat_width(width)))


def dashboard(views: list[DeviceView], selected: int, now: float, clock: str, *, width: int = 120,
              paused: bool = False, interactive: bool = False) -> Layout:
    """The dashboard as a full-screen Layout of a `width`-column screen, for `rich.live.Live`."""
    root = Layout()
    if not views:
        root.split_column(Layout(header(views, 0, clock, paused=paused), size=1), Layout(_no_devices()))
        return root
    view = views[selected]
    top = [Layout(header(views, selected, clock, paused=paused, interactive=interactive), size=1),
           Layout(Panel(Group(P.device_table(views, selected), P.notes_line(view)), title="devices"),
                  size=len(views) + 6)]
    if view.snapshot is None:
        root.split_column(*top, Layout(_absent(view)))
        return root
    left = Layout()
    left.split_column(Layout(P.capacity_panel(view), size=3),
                      Layout(P.bandwidth_panel(view, now, _spark_width(width)), size=7),
                      Layout(P.latency_panel(view)))
    right = Layout()
    right.split_column(Layout(P.kv_panel(view), size=10), Layout(P.queue_panel(view), size=7),
                       Layout(P.events_panel(view)))
    body = Layout()
    body.split_row(left, right)
    pool = P.pool_of(view)
    # the hosts panel: a border and header of 4 lines, a row per port, the pool's line (2 when it wraps)
    hosts = [Layout(P.hosts_panel(view), size=pool.hosts + 6)] if pool is not None else []
    root.split_column(*top, body, *hosts, Layout(P.heatmap_panel(view, _heat_width(width)), size=7))
    return root


class Monitor:
    """Watches the named devices (all devices when none are named)."""

    def __init__(self, names: list[str] | None = None, *, interval: float = 1.0,
                 console: Console | None = None) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.devices = DeviceSet(names)
        self.interval = interval
        self.console = console or Console()
        self.selected = 0
        self.paused = False
        self.views: list[DeviceView] = []

    def poll(self) -> list[DeviceView]:
        self.views = self.devices.poll(time.monotonic())
        self.selected = min(self.selected, max(len(self.views) - 1, 0))
        return self.views

    def run_frames(self, frames: int | None) -> int:
        """Print `frames` frames (None: until Ctrl-C), `interval` apart, and return 0."""
        try:
            for i in itertools.count() if frames is None else range(frames):
                if i:
                    time.sleep(self.interval)
                self.poll()
                clock = datetime.now().strftime("%H:%M:%S.%f")[:-3]
                self.console.rule(f"frame {i + 1}" + (f"/{frames}" if frames is not None else ""))
                self.console.print(dashboard_grid(self.views, self.selected, time.monotonic(), clock,
                                                  self.console.width))
        except KeyboardInterrupt:
            pass
        finally:
            self.devices.close()
        return 0

    def handle_key(self, key: str) -> bool:
        """Apply a key; False when it asks to quit."""
        if key in ("q", "Q"):
            return False
        if key in ("right", "n", "tab", "down") and self.views:
            self.selected = (self.selected + 1) % len(self.views)
        elif key in ("left", "N", "up") and self.views:
            self.selected = (self.selected - 1) % len(self.views)
        elif key in ("space", "p"):
            self.paused = not self.paused
        return True

    def run_live(self) -> int:
        """Redraw in place until 'q' or Ctrl-C; the terminal mode is restored on the way out."""
        try:
            with KeyReader() as keys, Live(console=self.console, screen=keys.interactive,
                                           auto_refresh=False, transient=False) as live:
                while True:
                    if not self.paused:
                        self.poll()
                    clock = datetime.now().strftime("%H:%M:%S")
                    live.update(dashboard(self.views, self.selected, time.monotonic(), clock,
                                          width=self.console.width, paused=self.paused,
                                          interactive=keys.interactive), refresh=True)
                    deadline = time.monotonic() + self.interval
                    while (left := deadline - time.monotonic()) > 0:
                        key = keys.read(left)
                        if key is None:
                            continue
                        if not self.handle_key(key):
                            return 0
                        break  # redraw at once so the key's effect shows
        except KeyboardInterrupt:
            return 0
        finally:
            self.devices.close()
