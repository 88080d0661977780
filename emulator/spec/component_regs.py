"""Component registers (CXL r3.1 §8.2.4): the CXL.cache/mem capability array, RAS and HDM decoders.

Offsets are absolute in the BAR, like `emulator.spec.registers`. The 64 KiB component block sits
at `COMPONENT_OFFSET`; its first 4 KiB are CXL.io (unused: there is no link to train), the next
4 KiB hold the CXL.cache/mem registers (§8.2.4, Table 8-22)::

    COMPONENT_OFFSET + 0x1000  CM_OFFSET    CXL_Capability_Header, then one header per capability
                     + 0x1100  RAS_OFFSET   RAS capability (ID 2), 0x58 bytes (§8.2.4.17)
                     + 0x1200  HDM_OFFSET   HDM decoder capability (ID 5), 0x10 + 0x20 * n (§8.2.4.20)

Access notes: the spec marks the decoder registers "RWL" (writable until locked by
LOCK_ON_COMMIT); `Access` has no such member, so they are RW here and the lock is enforced by the
firmware (`emulator.component.HdmDecoderBlock`). Versions and reset values follow QEMU
(hw/cxl/cxl-component-utils.c), which Linux probes without complaint.
"""
from __future__ import annotations

from typing import NamedTuple

from emulator.spec.registers import COMPONENT_OFFSET, COMPONENT_SIZE, Access, Field, Reg

CM_OFFSET = COMPONENT_OFFSET + 0x1000
CM_SIZE = 0x1000
RAS_OFFSET = CM_OFFSET + 0x100
RAS_SIZE = 0x58  # §8.2.4.17: through the 16-DWORD header log
HDM_OFFSET = CM_OFFSET + 0x200

# §8.2.4, Table 8-22: CXL_Capability_ID values in the CXL.cache/mem capability array.
CM_CAP_ID_ARRAY = 0x1
CM_CAP_ID_RAS = 0x2
CM_CAP_ID_HDM = 0x5
RAS_CAP_VERSION = 2  # QEMU init_cap_reg(RAS, 2, 2)
HDM_CAP_VERSION = 1  # QEMU init_cap_reg(HDM, 5, 1)

# §8.2.4.20: 256 MiB is the unit of decoder base, size and DPA skip (bits [31:28] of each LO).
HDM_DECODER_ALIGN = 256 << 20
HDM_DECODER_STRIDE = 0x20
HDM_DECODER0_OFFSET = HDM_OFFSET + 0x10
# §8.2.4.20.1 Decoder Count encoding for a device: 0 -> 1 decoder, n -> 2n decoders (QEMU
# cxl_decoder_count_enc); switches and host bridges go further, a Type-3 device stops at 10.
DECODER_COUNT_ENC: dict[int, int] = {1: 0, 2: 1, 4: 2, 6: 3, 8: 4, 10: 5}
DECODER_COUNT_DEC: dict[int, int] = {enc: n for n, enc in DECODER_COUNT_ENC.items()}

# ---- capability array (§8.2.4.1 - §8.2.4.5) -------------------------------------------------------

CM_CAP_HEADER = Reg("CM_CAP_HEADER", CM_OFFSET, 4, Access.RO, "8.2.4.1", (
    Field("CAP_ID", 0, 15), Field("CAP_VERSION", 16, 19), Field("CACHE_MEM_VERSION", 20, 23),
    Field("ARRAY_SIZE", 24, 31),
))


def cm_cap_element(index: int) -> Reg:
    """Header `index` (1-based) of the CXL.cache/mem capability array; POINTER is from CM_OFFSET."""
    return Reg(f"CM_CAP_ELEMENT{index}", CM_OFFSET + 4 * index, 4, Access.RO, "8.2.4.2", (
        Field("CAP_ID", 0, 15), Field("CAP_VERSION", 16, 19), Field("POINTER", 20, 31),
    ))


# (capability id, version, absolute offset) in array order, as laid out by init_component_registers.
CM_CAPABILITIES: tuple[tuple[int, int, int], ...] = (
    (CM_CAP_ID_RAS, RAS_CAP_VERSION, RAS_OFFSET),
    (CM_CAP_ID_HDM, HDM_CAP_VERSION, HDM_OFFSET),
)

# ---- RAS capability (§8.2.4.17) -----------------------------------------------------------------

_UNCORRECTABLE = (
    Field("CACHE_DATA_PARITY", 0, 0), Field("CACHE_ADDRESS_PARITY", 1, 1), Field("CACHE_BE_PARITY", 2, 2),
    Field("CACHE_DATA_ECC", 3, 3), Field("MEM_DATA_PARITY", 4, 4), Field("MEM_ADDRESS_PARITY", 5, 5),
    Field("MEM_BE_PARITY", 6, 6), Field("MEM_DATA_ECC", 7, 7), Field("REINIT_THRESHOLD", 8, 8),
    Field("RSVD_ENCODING_VIOLATION", 9, 9), Field("POISON_RECEIVED", 10, 10),
    Field("RECEIVER_OVERFLOW", 11, 11), Field("INTERNAL_ERROR", 14, 14), Field("CXL_IDE_TX_ERROR", 15, 15),
    Field("CXL_IDE_RX_ERROR", 16, 16),
)
_CORRECTABLE = (
    Field("CACHE_DATA_ECC", 0, 0), Field("MEM_DATA_ECC", 1, 1), Field("CRC_THRESHOLD", 2, 2),
    Field("RETRY_THRESHOLD", 3, 3), Field("CACHE_POISON_RECEIVED", 4, 4), Field("MEM_POISON_RECEIVED", 5, 5),
    Field("PHYSICAL_LAYER_ERROR", 6, 6),
)
RAS_UNCORRECTABLE_MASK = 0x1CFFF  # bits 12-13 and 17-31 reserved (Linux CXL_RAS_UNCORRECTABLE_STATUS_MASK)
RAS_CORRECTABLE_MASK = 0x7F

RAS_UNC_STATUS = Reg("RAS_UNC_STATUS", RAS_OFFSET + 0x00, 4, Access.RW1C, "8.2.4.17.1", _UNCORRECTABLE)
RAS_UNC_MASK = Reg("RAS_UNC_MASK", RAS_OFFSET + 0x04, 4, Access.RW, "8.2.4.17.2", _UNCORRECTABLE)
RAS_UNC_SEVERITY = Reg("RAS_UNC_SEVERITY", RAS_OFFSET + 0x08, 4, Access.RW, "8.2.4.17.3", _UNCORRECTABLE)
RAS_COR_STATUS = Reg("RAS_COR_STATUS", RAS_OFFSET + 0x0C, 4, Access.RW1C, "8.2.4.17.4", _CORRECTABLE)
RAS_COR_MASK = Reg("RAS_COR_MASK", RAS_OFFSET + 0x10, 4, Access.RW, "8.2.4.17.5", _CORRECTABLE)
RAS_CAP_CTRL = Reg("RAS_CAP_CTRL", RAS_OFFSET + 0x14, 4, Access.RW, "8.2.4.17.6", (
    Field("FIRST_ERROR_POINTER", 0, 5), Field("MULTIPLE_HEADER_RECORDING", 9, 9),
    Field("POISON_ENABLED", 13, 13),
))
RAS_HEADER_LOG_OFFSET = RAS_OFFSET + 0x18  # §8.2.4.17.7: 16 DWORDs of the first error's header
RAS_HEADER_LOG_SIZE = 0x40
assert RAS_HEADER_LOG_OFFSET + RAS_HEADER_LOG_SIZE == RAS_OFFSET + RAS_SIZE

RAS_REGISTERS: tuple[Reg, ...] = (
    RAS_UNC_STATUS, RAS_UNC_MASK, RAS_UNC_SEVERITY, RAS_COR_STATUS, RAS_COR_MASK, RAS_CAP_CTRL,
)
# Reset values: every error masked, every uncorrectable error fatal (QEMU ras_init_common; the spec
# defaults of §8.2.4.17.2-5); multiple-header recording capable, and Poison_Enabled, which §8.2.4.17.6
# hardwires to 1 in CXL devices that are not eRCDs (QEMU leaves it 0).
RAS_RESET: dict[Reg, int] = {
    RAS_UNC_MASK: RAS_UNCORRECTABLE_MASK, RAS_UNC_SEVERITY: RAS_UNCORRECTABLE_MASK,
    RAS_COR_MASK: RAS_CORRECTABLE_MASK, RAS_CAP_CTRL: 1 << 9 | 1 << 13,
}

# ---- HDM decoder capability (§8.2.4.20) ---------------------------------------------------------

HDM_CAP = Reg("HDM_CAP", HDM_OFFSET + 0x00, 4, Access.RO, "8.2.4.20.1", (
    Field("DECODER_COUNT", 0, 3), Field("TARGET_COUNT", 4, 7), Field("INTERLEAVE_256B", 8, 8),
    Field("INTERLEAVE_4K", 9, 9), Field("POISON_ON_ERR_CAP", 10, 10), Field("IW_3_6_12", 11, 11),
    Field("IW_16", 12, 12), Field("UIO", 13, 13), Field("UIO_DECODER_COUNT", 16, 19),
    Field("MEMDATA_NXM", 20, 20), Field("COHERENCY_MODELS", 21, 22),
))
HDM_GLOBAL_CTRL = Reg("HDM_GLOBAL_CTRL", HDM_OFFSET + 0x04, 4, Access.RW, "8.2.4.20.2", (
    Field("POISON_ON_ERR_EN", 0, 0), Field("HDM_DECODER_ENABLE", 1, 1),
))

_LO_256M = (Field("LO", 28, 31),)  # bits [27:0] are reserved: 256 MiB granularity
_HI = (Field("HI", 0, 31),)
CTRL_FIELDS = (
    Field("IG", 0, 3), Field("IW", 4, 7), Field("LOCK_ON_COMMIT", 8, 8), Field("COMMIT", 9, 9),
    Field("COMMITTED", 10, 10), Field("ERR_NOT_COMMITTED", 11, 11), Field("TYPE", 12, 12),
)
CTRL_IG = CTRL_FIELDS[0]
CTRL_IW = CTRL_FIELDS[1]
CTRL_LOCK_ON_COMMIT = 1 << 8
CTRL_COMMIT = 1 << 9
CTRL_COMMITTED = 1 << 10
CTRL_ERR_NOT_COMMITTED = 1 << 11
CTRL_TYPE_HOST_ONLY = 1 << 12  # TYPE: 1 = host-only coherent (HDM-H), what a Type-3 expander uses
CTRL_HOST_WRITABLE = 0x13FF    # QEMU's write mask: IG, IW, LOCK, COMMIT, TYPE; COMMITTED/ERR are RO


class DecoderRegs(NamedTuple):
    """The registers of HDM decoder n of a device (where a switch has its target list, a device has
    the DPA skip, §8.2.4.20.9 and §8.2.4.20.11)."""

    BASE_LO: Reg
    BASE_HI: Reg
    SIZE_LO: Reg
    SIZE_HI: Reg
    CTRL: Reg
    SKIP_LO: Reg
    SKIP_HI: Reg


def hdm_decoder(n: int) -> DecoderRegs:
    """Register table of decoder `n`."""
    base = HDM_DECODER0_OFFSET + HDM_DECODER_STRIDE * n

    def reg(name: str, off: int, section: str, fields: tuple[Field, ...]) -> Reg:
        return Reg(f"HDM_DECODER{n}_{name}", base + off, 4, Access.RW, section, fields)

    return DecoderRegs(
        reg("BASE_LO", 0x00, "8.2.4.20.3", _LO_256M), reg("BASE_HI", 0x04, "8.2.4.20.4", _HI),
        reg("SIZE_LO", 0x08, "8.2.4.20.5", _LO_256M), reg("SIZE_HI", 0x0C, "8.2.4.20.6", _HI),
        reg("CTRL", 0x10, "8.2.4.20.7", CTRL_FIELDS),
        reg("SKIP_LO", 0x14, "8.2.4.20.9", _LO_256M), reg("SKIP_HI", 0x18, "8.2.4.20.11", _HI),
    )


def hdm_size(n_decoders: int) -> int:
    """Bytes of an HDM decoder capability with `n_decoders` decoders."""
    return 0x10 + HDM_DECODER_STRIDE * n_decoders


MAX_DECODERS = max(DECODER_COUNT_ENC)
assert HDM_OFFSET + hdm_size(MAX_DECODERS) <= CM_OFFSET + CM_SIZE
assert CM_OFFSET + CM_SIZE <= COMPONENT_OFFSET + COMPONENT_SIZE
assert RAS_OFFSET + RAS_SIZE <= HDM_OFFSET
assert hdm_decoder(1).CTRL.offset == HDM_OFFSET + 0x40  # §8.2.4.20: decoder n CTRL at 0x20 + 0x20 * n
