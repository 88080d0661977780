"""`MemDev.identity()`: Identify and Identify Memory Device as the one record `cxlemu identify` prints."""
from __future__ import annotations

from typing import Any

from emulator.spec.payloads import CXLEMU_DEVICE_ID, CXLEMU_VENDOR_ID
from emulator.spec.registers import MAILBOX_PAYLOAD_LOG2


def test_identity_is_both_identify_commands_in_one_record(served: Any, memdev: Any) -> None:
    config = served.files.config
    assert memdev.identity() == {
        "vendor_id": CXLEMU_VENDOR_ID, "device_id": CXLEMU_DEVICE_ID, "subsys_vendor_id": CXLEMU_VENDOR_ID,
        "subsys_id": CXLEMU_DEVICE_ID, "serial": config.serial, "max_msg_size": MAILBOX_PAYLOAD_LOG2,
        "component_type": 3, "fw_revision": config.fw_revision, "total_bytes": 256 << 20,
        "volatile_bytes": 256 << 20, "persistent_bytes": 0, "partition_align_bytes": 0,
        "event_log_sizes": {"info": 64, "warning": 64, "failure": 64, "fatal": 64, "dynamic_capacity": 64},
        "lsa_size": 128 << 10, "poison_list_max": 256, "inject_poison_limit": 0, "poison_caps": 2,
        "qos_telemetry_caps": 0}
    assert memdev.identity()["serial"] == memdev.identify().serial
    assert memdev.identity()["fw_revision"] == memdev.identify_memdev().fw_revision
