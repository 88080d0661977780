"""The health model on simulated time: temperature, life used, corrected errors, edge-triggered
alerts, and the firmware service that feeds it from the link counters."""
from __future__ import annotations

import math
import struct

from mbox_support import firmware

from emulator.commands.health import HEALTH_PERIOD_NS, HealthService, link_bytes
from emulator.health import (
    AMBIENT_C,
    HEAT_C_PER_GBPS,
    MAX_RISE_C,
    RATED_LIFE_NS,
    THERMAL_TAU_S,
    Alert,
    AlertConfig,
    HealthState,
)
from emulator.mailbox import dispatch
from emulator.spec import payloads_memdev as P
from emulator.spec import registers as R
from emulator.timing import linkstate as L

S = 10**9
GB = 10**9


def test_temperature_follows_the_first_order_model():
    h = HealthState(start_ns=0)
    assert h.advance(0, 0) == []
    h.advance(20 * S, 20 * GB)  # 1 GB/s for one time constant
    expected = AMBIENT_C + HEAT_C_PER_GBPS * 1.0 * (1 - math.exp(-20 / THERMAL_TAU_S))
    assert h.temperature_c == expected
    assert h.temperature == round(expected) == 36
    h.advance(10_000 * S, 20 * GB)  # idle for hours: back to ambient
    assert h.temperature == AMBIENT_C


def test_temperature_rise_saturates():
    h = HealthState(start_ns=0)
    h.advance(0, 0)
    h.advance(1000 * S, 1000 * 1000 * GB)  # 1 TB/s for 50 time constants
    assert h.temperature == AMBIENT_C + MAX_RISE_C


def test_over_temperature_warning_is_edge_triggered():
    h = HealthState(start_ns=0)
    h.alerts = AlertConfig(enabled=P.ALERT_OVER_TEMP, over_temp_warning=45)
    h.advance(0, 0)
    moved, alerts = 0, []
    for step in range(1, 61):  # 10 GB/s: heads for 50 C
        moved += 10 * GB
        alerts += h.advance(step * S, moved)
    assert alerts == [Alert("temperature", P.LEVEL_WARNING, 45)]
    assert h.additional_status() >> 2 & 3 == P.LEVEL_WARNING
    assert h.health_status() == 0
    for step in range(61, 400):  # idle: cools below the threshold
        h.advance(step * S, moved)
    assert h.temperature == 35 and h.additional_status() == 0
    for step in range(400, 460):  # hot again: a second alert
        moved += 10 * GB
        alerts += h.advance(step * S, moved)
    assert alerts == [Alert("temperature", P.LEVEL_WARNING, 45)] * 2


def test_critical_temperature_degrades_performance():
    h = HealthState(start_ns=0)
    h.advance(0, 0)
    moved, alerts = 0, []
    for step in range(1, 200):  # 40 GB/s: heads for 95 C, past the 85 C critical threshold
        moved += 40 * GB
        alerts += h.advance(step * S, moved)
    assert [a.level for a in alerts] == [P.LEVEL_CRITICAL]  # warnings are off: only critical
    assert h.health_status() == P.HEALTH_PERFORMANCE_DEGRADED
    assert h.additional_status() >> 2 & 3 == P.LEVEL_CRITICAL


def test_life_used_counts_power_on_time():
    h = HealthState(start_ns=5 * S)
    h.alerts = AlertConfig(enabled=P.ALERT_LIFE_USED, life_used_warning=50)
    h.advance(5 * S, 0)
    assert h.life_used == 0
    assert h.advance(5 * S + RATED_LIFE_NS // 2, 0) == [Alert("life_used", P.LEVEL_WARNING, 50)]
    assert h.advance(5 * S + RATED_LIFE_NS * 9 // 10, 0) == [Alert("life_used", P.LEVEL_CRITICAL, 90)]
    assert h.health_status() == P.HEALTH_MAINTENANCE_NEEDED
    h.advance(5 * S + RATED_LIFE_NS, 0)
    assert h.life_used == 100
    assert h.health_status() == P.HEALTH_MAINTENANCE_NEEDED | P.HEALTH_REPLACEMENT_NEEDED


def test_corrected_error_warnings():
    h = HealthState(start_ns=0)
    h.alerts = AlertConfig(enabled=P.ALERT_CORRECTED_VOLATILE | P.ALERT_CORRECTED_PERSISTENT,
                           corrected_volatile_warning=3, corrected_persistent_warning=1)
    assert h.note_corrected_error() == []
    assert h.note_corrected_error() == []
    assert h.note_corrected_error() == [Alert("corrected_volatile", 1, 3)]
    assert h.note_corrected_error() == []
    assert h.note_corrected_error(persistent=True) == [Alert("corrected_persistent", 1, 1)]
    assert h.additional_status() == P.ADDITIONAL_VOLATILE_ERRORS_WARNING | P.ADDITIONAL_PERSISTENT_ERRORS_WARNING


def test_alert_config_rules():
    assert AlertConfig(enabled=P.ALERT_OVER_TEMP, over_temp_warning=84).validate() is None
    assert AlertConfig(enabled=P.ALERT_OVER_TEMP, over_temp_warning=85).validate() is not None
    assert AlertConfig(enabled=P.ALERT_UNDER_TEMP, under_temp_warning=0).validate() is not None
    assert AlertConfig(enabled=P.ALERT_LIFE_USED, life_used_warning=90).validate() is not None
    both = AlertConfig(enabled=P.ALERT_OVER_TEMP | P.ALERT_UNDER_TEMP, over_temp_warning=40, under_temp_warning=40)
    assert both.validate() is not None
    assert AlertConfig(enabled=0, over_temp_warning=200).validate() is None  # disabled: not checked


def test_service_reads_the_link_counters_and_logs_events():
    with firmware() as fw:
        base = R.LINK_STATE_OFFSET
        assert link_bytes(fw) == 0  # page not stamped by a data path: no traffic known
        fw.regs.write(base, 8, L.MAGIC)
        fw.regs.write(base + 8 * (L.dir_word(L.DIR_READ) + L.BYTES), 8, 3000)
        fw.regs.write(base + 8 * (L.dir_word(L.DIR_WRITE) + L.BYTES), 8, 400)
        fw.regs.write(base + 8 * (L.COPY_WORD + L.BYTES), 8, 50)
        assert link_bytes(fw) == 3450
        # hand the model simulated time through the service (the runner passes monotonic ns)
        fw.health = HealthState(start_ns=0)
        fw.health.alerts = AlertConfig(enabled=P.ALERT_OVER_TEMP, over_temp_warning=40)
        service = HealthService(fw)
        service(0)
        read_word = base + 8 * (L.dir_word(L.DIR_READ) + L.BYTES)
        before = fw.events.count(1) if hasattr(fw, "events") else None
        reference = HealthState(start_ns=0)
        reference.advance(0, 3450)
        for step in range(1, 40):
            fw.regs.write(read_word, 8, fw.regs.read(read_word, 8) + 10 * GB)
            service(step * S)
            service(step * S + HEALTH_PERIOD_NS // 2)  # within the period: no update
            reference.advance(step * S, 3450 + step * 10 * GB)
        assert fw.health.temperature_c == reference.temperature_c
        assert fw.health.temperature == 48
        out = dispatch(fw, 0x4200, b"")[1]
        assert struct.unpack_from("<h", out, 4)[0] == fw.health.temperature
        if before is not None:
            assert fw.events.count(1) == before + 1  # one warning record for one crossing


def test_bytes_counted_at_an_unchanged_time_are_not_lost():
    h, ref = HealthState(start_ns=0), HealthState(start_ns=0)
    h.advance(0, 0)
    ref.advance(0, 0)
    h.advance(0, 10 * GB)  # same instant: integrated with the next sample
    h.advance(S, 20 * GB)
    ref.advance(S, 20 * GB)
    assert h.temperature_c == ref.temperature_c > AMBIENT_C
