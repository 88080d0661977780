"""Mailbox command opcodes (CXL r3.1 §8.2.9, Table 8-37 and 8-126): opcode = command set << 8 | command."""
from __future__ import annotations

from enum import IntEnum


class Opcode(IntEnum):
    # §8.2.9.1 Generic component commands
    IDENTIFY = 0x0001
    BACKGROUND_OPERATION_STATUS = 0x0002
    REQUEST_BACKGROUND_ABORT = 0x0005
    # §8.2.9.2 Events
    GET_EVENT_RECORDS = 0x0100
    CLEAR_EVENT_RECORDS = 0x0101
    GET_EVENT_INTERRUPT_POLICY = 0x0102
    SET_EVENT_INTERRUPT_POLICY = 0x0103
    # §8.2.9.3 Firmware update
    GET_FW_INFO = 0x0200
    TRANSFER_FW = 0x0201
    ACTIVATE_FW = 0x0202
    # §8.2.9.4 Timestamp
    GET_TIMESTAMP = 0x0300
    SET_TIMESTAMP = 0x0301
    # §8.2.9.5 Logs
    GET_SUPPORTED_LOGS = 0x0400
    GET_LOG = 0x0401
    # §8.2.9.9.1 Identify / capacity configuration
    IDENTIFY_MEMORY_DEVICE = 0x4000
    GET_PARTITION_INFO = 0x4100
    SET_PARTITION_INFO = 0x4101
    GET_LSA = 0x4102
    SET_LSA = 0x4103
    # §8.2.9.9.3 Health information and alerts
    GET_HEALTH_INFO = 0x4200
    GET_ALERT_CONFIG = 0x4201
    SET_ALERT_CONFIG = 0x4202
    # §8.2.9.9.4 Media and poison management
    GET_POISON_LIST = 0x4300
    INJECT_POISON = 0x4301
    CLEAR_POISON = 0x4302
    GET_SCAN_MEDIA_CAPABILITIES = 0x4303
    SCAN_MEDIA = 0x4304
    GET_SCAN_MEDIA_RESULTS = 0x4305
    # §8.2.9.9.5 Sanitize
    SANITIZE = 0x4400
    SECURE_ERASE = 0x4401  # Linux CXL_MBOX_OP_SECURE_ERASE
    # §8.2.9.9.6 Persistent memory data-at-rest security
    GET_SECURITY_STATE = 0x4500
    # §8.2.9.9.9 Dynamic Capacity
    GET_DC_CONFIG = 0x4800
    GET_DC_EXTENT_LIST = 0x4801
    ADD_DC_RESPONSE = 0x4802
    RELEASE_DC = 0x4803
    # cxlemu vendor commands: the fabric manager's Dynamic Capacity requests, sent in-band
    FM_ADD_DC = 0xC000
    FM_RELEASE_DC = 0xC001
    FM_LIST_DC = 0xC002
    FM_CREATE_KV_POOL = 0xC003  # the shared KV index's extent, offered to hosts and formatted


def opcode_name(opcode: int) -> str:
    """'IDENTIFY_MEMORY_DEVICE' for 0x4000, or 'UNKNOWN_0xNNNN'."""
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"UNKNOWN_{opcode:#06x}"
