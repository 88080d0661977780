"""Mailbox return codes, CXL r3.1 §8.2.8.4.5.1 Table 8-34 (Linux CMD_CMD_RC_TABLE, QEMU CXLRetCode)."""
from __future__ import annotations

from enum import IntEnum


class RetCode(IntEnum):
    SUCCESS = 0x00
    BACKGROUND_COMMAND_STARTED = 0x01
    INVALID_INPUT = 0x02
    UNSUPPORTED = 0x03
    INTERNAL_ERROR = 0x04
    RETRY_REQUIRED = 0x05
    BUSY = 0x06
    MEDIA_DISABLED = 0x07
    FW_TRANSFER_IN_PROGRESS = 0x08
    FW_TRANSFER_OUT_OF_ORDER = 0x09
    FW_AUTHENTICATION_FAILED = 0x0A
    FW_INVALID_SLOT = 0x0B
    FW_ROLLED_BACK = 0x0C
    FW_RESET_REQUIRED = 0x0D
    INVALID_HANDLE = 0x0E
    INVALID_PHYSICAL_ADDRESS = 0x0F
    INJECT_POISON_LIMIT_REACHED = 0x10
    PERMANENT_MEDIA_FAILURE = 0x11
    ABORTED = 0x12
    INVALID_SECURITY_STATE = 0x13
    INCORRECT_PASSPHRASE = 0x14
    UNSUPPORTED_MAILBOX = 0x15
    INVALID_PAYLOAD_LENGTH = 0x16
    INVALID_LOG = 0x17
    INTERRUPTED = 0x18
    UNSUPPORTED_FEATURE_VERSION = 0x19
    UNSUPPORTED_FEATURE_SELECTION_VALUE = 0x1A
    FEATURE_TRANSFER_IN_PROGRESS = 0x1B
    FEATURE_TRANSFER_OUT_OF_ORDER = 0x1C
    RESOURCES_EXHAUSTED = 0x1D
    INVALID_EXTENT_LIST = 0x1E
    TRANSFER_OUT_OF_ORDER = 0x1F
    REQUEST_ABORT_NOT_SUPPORTED = 0x20


_NAMES = {
    RetCode.SUCCESS: "Success",
    RetCode.BACKGROUND_COMMAND_STARTED: "Background Command Started",
    RetCode.INVALID_INPUT: "Invalid Input",
    RetCode.UNSUPPORTED: "Unsupported",
    RetCode.INTERNAL_ERROR: "Internal Error",
    RetCode.RETRY_REQUIRED: "Retry Required",
    RetCode.BUSY: "Busy",
    RetCode.MEDIA_DISABLED: "Media Disabled",
    RetCode.FW_TRANSFER_IN_PROGRESS: "FW Transfer in Progress",
    RetCode.FW_TRANSFER_OUT_OF_ORDER: "FW Transfer Out of Order",
    RetCode.FW_AUTHENTICATION_FAILED: "FW Authentication Failed",
    RetCode.FW_INVALID_SLOT: "FW Invalid Slot",
    RetCode.FW_ROLLED_BACK: "FW Rolled Back",
    RetCode.FW_RESET_REQUIRED: "FW Reset Required",
    RetCode.INVALID_HANDLE: "Invalid Handle",
    RetCode.INVALID_PHYSICAL_ADDRESS: "Invalid Physical Address",
    RetCode.INJECT_POISON_LIMIT_REACHED: "Inject Poison Limit Reached",
    RetCode.PERMANENT_MEDIA_FAILURE: "Permanent Media Failure",
    RetCode.ABORTED: "Aborted",
    RetCode.INVALID_SECURITY_STATE: "Invalid Security State",
    RetCode.INCORRECT_PASSPHRASE: "Incorrect Passphrase",
    RetCode.UNSUPPORTED_MAILBOX: "Unsupported Mailbox",
    RetCode.INVALID_PAYLOAD_LENGTH: "Invalid Payload Length",
    RetCode.INVALID_LOG: "Invalid Log",
    RetCode.INTERRUPTED: "Interrupted",
    RetCode.UNSUPPORTED_FEATURE_VERSION: "Unsupported Feature Version",
    RetCode.UNSUPPORTED_FEATURE_SELECTION_VALUE: "Unsupported Feature Selection Value",
    RetCode.FEATURE_TRANSFER_IN_PROGRESS: "Feature Transfer in Progress",
    RetCode.FEATURE_TRANSFER_OUT_OF_ORDER: "Feature Transfer Out of Order",
    RetCode.RESOURCES_EXHAUSTED: "Resources Exhausted",
    RetCode.INVALID_EXTENT_LIST: "Invalid Extent List",
    RetCode.TRANSFER_OUT_OF_ORDER: "Transfer Out of Order",
    RetCode.REQUEST_ABORT_NOT_SUPPORTED: "Request Abort Not Supported",
}
assert len(_NAMES) == len(RetCode) == 0x21, "every return code 0x00-0x20 has a name"


def retcode_name(code: int) -> str:
    """Spec name of a return code, or 'Unknown (0xNN)' for a value outside the table."""
    try:
        return _NAMES[RetCode(code)]
    except ValueError:
        return f"Unknown ({code:#04x})"
