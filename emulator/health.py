"""The device's health: a thermal model, life used, corrected errors, and the alert thresholds.

What Get Health Info (§8.2.9.9.3.1) and Get / Set Alert Configuration (§8.2.9.9.3.2-3) report.
The firmware advances the model from the link's byte counters; tests advance it with simulated
time and traffic (`advance(now_ns, bytes_moved)`), so every value here is reproducible.

    temperature   first-order thermal model: the die heats toward
                  AMBIENT_C + HEAT_C_PER_GBPS x throughput with time constant THERMAL_TAU_S
    life used     power-on time over the rated DRAM service life (DRAM does not wear by writes)
    errors        corrected volatile / persistent error counts, raised by `note_corrected_error`

Alerts are edge-triggered, as the spec's "the device shall generate an event when the value
crosses the threshold": one `Alert` when a level is entered, none while it stays there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from emulator.spec import payloads_memdev as P

AMBIENT_C = 35.0            # idle die temperature of a DDR5 module in a server, degrees C
HEAT_C_PER_GBPS = 1.5       # steady-state rise per GB/s of media traffic
MAX_RISE_C = 60.0           # the rise saturates (the module throttles before this)
THERMAL_TAU_S = 20.0        # heat-sink time constant
RATED_LIFE_NS = 5 * 365 * 24 * 3600 * 10**9  # 5-year rated service life

# Device-fixed critical thresholds (§8.2.9.9.3.2: "critical alert" values are not programmable).
LIFE_USED_CRITICAL = 90
OVER_TEMP_CRITICAL = 85
UNDER_TEMP_CRITICAL = 0


@dataclass(frozen=True)
class Alert:
    """A threshold crossing: `what` is 'life_used', 'temperature', 'corrected_volatile' or
    'corrected_persistent'; `level` is P.LEVEL_WARNING or P.LEVEL_CRITICAL."""

    what: str
    level: int
    value: int


@dataclass
class AlertConfig:
    """The programmable warning thresholds and which of them are enabled (§8.2.9.9.3.3)."""

    enabled: int = 0
    life_used_warning: int = 0
    over_temp_warning: int = 0
    under_temp_warning: int = 0
    corrected_volatile_warning: int = 0
    corrected_persistent_warning: int = 0

    def validate(self) -> str | None:
        """Why this configuration is invalid (§8.2.9.9.3.3 rules), or None."""
        if self.enabled & P.ALERT_LIFE_USED and self.life_used_warning >= LIFE_USED_CRITICAL:
            return f"life used warning {self.life_used_warning} must be below {LIFE_USED_CRITICAL}"
        if self.enabled & P.ALERT_OVER_TEMP and self.over_temp_warning >= OVER_TEMP_CRITICAL:
            return f"over-temperature warning {self.over_temp_warning} must be below {OVER_TEMP_CRITICAL}"
        if self.enabled & P.ALERT_UNDER_TEMP and self.under_temp_warning <= UNDER_TEMP_CRITICAL:
            return f"under-temperature warning {self.under_temp_warning} must be above {UNDER_TEMP_CRITICAL}"
        if (self.enabled & P.ALERT_OVER_TEMP and self.enabled & P.ALERT_UNDER_TEMP
                and self.under_temp_warning >= self.over_temp_warning):
            return "under-temperature warning must be below the over-temperature warning"
        return None


@dataclass
class HealthState:
    """Health values and their alert levels; time and traffic are passed in."""

    start_ns: int
    temperature_c: float = AMBIENT_C
    corrected_volatile_errors: int = 0
    corrected_persistent_errors: int = 0
    dirty_shutdowns: int = 0
    state_unsaved: bool = False  # the device's own state cannot be saved (emulator/persist.py)
    alerts: AlertConfig = field(default_factory=AlertConfig)
    _last_ns: int | None = None
    _last_bytes: int = 0
    _now_ns: int = 0
    _levels: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._now_ns = self.start_ns

    # model -------------------------------------------------------------------------------------
    def advance(self, now_ns: int, bytes_moved: int) -> list[Alert]:
        """Move the model to `now_ns`, given the link's cumulative byte count; returns new alerts."""
        if self._last_ns is None:  # the first sample only sets the baseline
            self._last_ns, self._last_bytes = now_ns, bytes_moved
            self._now_ns = max(self._now_ns, now_ns)
            return self.check_alerts()
        if now_ns <= self._last_ns:  # no time has passed: nothing to integrate yet
            return self.check_alerts()
        dt_s = (now_ns - self._last_ns) / 1e9
        gbps = max(0, bytes_moved - self._last_bytes) / dt_s / 1e9
        steady = AMBIENT_C + min(MAX_RISE_C, HEAT_C_PER_GBPS * gbps)
        self.temperature_c += (steady - self.temperature_c) * (1.0 - math.exp(-dt_s / THERMAL_TAU_S))
        self._last_ns, self._last_bytes, self._now_ns = now_ns, bytes_moved, now_ns
        return self.check_alerts()

    def note_corrected_error(self, *, persistent: bool = False) -> list[Alert]:
        """A corrected media error (scrub, ECC) happened; returns new alerts."""
        if persistent:
            self.corrected_persistent_errors = min(self.corrected_persistent_errors + 1, 0xFFFF_FFFF)
        else:
            self.corrected_volatile_errors = min(self.corrected_volatile_errors + 1, 0xFFFF_FFFF)
        return self.check_alerts()

    @property
    def temperature(self) -> int:
        return round(self.temperature_c)

    @property
    def life_used(self) -> int:
        return min(100, (self._now_ns - self.start_ns) * 100 // RATED_LIFE_NS)

    # levels ------------------------------------------------------------------------------------
    def levels(self) -> dict[str, int]:
        """Current level per monitored value (P.LEVEL_NORMAL / WARNING / CRITICAL)."""
        cfg, on = self.alerts, self.alerts.enabled
        life, temp = self.life_used, self.temperature
        life_lvl = (P.LEVEL_CRITICAL if life >= LIFE_USED_CRITICAL else
                    P.LEVEL_WARNING if on & P.ALERT_LIFE_USED and life >= cfg.life_used_warning else
                    P.LEVEL_NORMAL)
        temp_lvl = (P.LEVEL_CRITICAL if temp >= OVER_TEMP_CRITICAL or temp <= UNDER_TEMP_CRITICAL else
                    P.LEVEL_WARNING if (on & P.ALERT_OVER_TEMP and temp >= cfg.over_temp_warning)
                    or (on & P.ALERT_UNDER_TEMP and temp <= cfg.under_temp_warning) else
                    P.LEVEL_NORMAL)
        vol = int(bool(on & P.ALERT_CORRECTED_VOLATILE)
                  and self.corrected_volatile_errors >= cfg.corrected_volatile_warning)
        pers = int(bool(on & P.ALERT_CORRECTED_PERSISTENT)
                   and self.corrected_persistent_errors >= cfg.corrected_persistent_warning)
        return {"life_used": life_lvl, "temperature": temp_lvl, "corrected_volatile": vol,
                "corrected_persistent": pers}

    def check_alerts(self) -> list[Alert]:
        """Alerts for levels entered since the last check (rising edges only)."""
        values = {"life_used": self.life_used, "temperature": self.temperature,
                  "corrected_volatile": self.corrected_volatile_errors,
                  "corrected_persistent": self.corrected_persistent_errors}
        new: list[Alert] = []
        for what, level in self.levels().items():
            if level > self._levels.get(what, P.LEVEL_NORMAL):
                new.append(Alert(what, level, values[what]))
            self._levels[what] = level
        return new

    def health_status(self) -> int:
        lv = self.levels()
        status = 0
        if lv["life_used"] == P.LEVEL_CRITICAL:
            status |= P.HEALTH_MAINTENANCE_NEEDED
        if self.life_used >= 100:
            status |= P.HEALTH_REPLACEMENT_NEEDED
        if lv["temperature"] == P.LEVEL_CRITICAL:
            status |= P.HEALTH_PERFORMANCE_DEGRADED  # the module throttles to cool down
        if self.state_unsaved:
            status |= P.HEALTH_MAINTENANCE_NEEDED  # an operator must make its folder writable
        return status

    def additional_status(self) -> int:
        lv = self.levels()
        return (lv["life_used"] | lv["temperature"] << 2
                | (P.ADDITIONAL_VOLATILE_ERRORS_WARNING if lv["corrected_volatile"] else 0)
                | (P.ADDITIONAL_PERSISTENT_ERRORS_WARNING if lv["corrected_persistent"] else 0))

    def snapshot(self, *, media_ready: bool) -> dict[str, int]:
        """The Get Health Info fields by name (also what a Memory Module event record carries)."""
        return {
            "health_status": self.health_status(),
            "media_status": P.MEDIA_STATUS_NORMAL if media_ready else P.MEDIA_STATUS_NOT_READY,
            "additional_status": self.additional_status(), "life_used": self.life_used,
            "temperature": self.temperature, "dirty_shutdowns": self.dirty_shutdowns,
            "corrected_volatile_errors": self.corrected_volatile_errors,
            "corrected_persistent_errors": self.corrected_persistent_errors}

    def info(self, *, media_ready: bool) -> bytes:
        """The Get Health Info output payload."""
        return P.HEALTH_INFO.pack(**self.snapshot(media_ready=media_ready))

    def alert_config(self) -> bytes:
        """The Get Alert Configuration output payload."""
        cfg = self.alerts
        return P.ALERT_CONFIG.pack(
            valid_alerts=cfg.enabled, programmable_alerts=P.ALERT_ALL,
            life_used_critical=LIFE_USED_CRITICAL, life_used_warning=cfg.life_used_warning,
            over_temp_critical=OVER_TEMP_CRITICAL, under_temp_critical=UNDER_TEMP_CRITICAL,
            over_temp_warning=cfg.over_temp_warning, under_temp_warning=cfg.under_temp_warning,
            corrected_volatile_warning=cfg.corrected_volatile_warning,
            corrected_persistent_warning=cfg.corrected_persistent_warning)
