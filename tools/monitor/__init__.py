"""`cxlemu monitor`: a rich dashboard of devices, drawn from their telemetry pages."""
from tools.monitor.app import Monitor, dashboard, dashboard_grid, header
from tools.monitor.history import LinkHistory, Rate, sparkline
from tools.monitor.source import DeviceSet, DeviceSource, DeviceView

__all__ = [
    "DeviceSet", "DeviceSource", "DeviceView", "LinkHistory", "Monitor", "Rate", "dashboard",
    "dashboard_grid", "header", "sparkline",
]
