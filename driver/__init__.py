"""The host side: open a device, speak the mailbox, program decoders, move data."""
from emulator.spec.errors import (CxlemuError, DeviceFileDamaged, DeviceFileError, DeviceGone, DeviceNotFound,
                                  DmaError, MailboxError, MailboxTimeout, MediaDisabled, NoExtent, NoSpace, NoSuchHost,
                                  PoisonError, PortClaimed, UnsafePath)

from driver._dc_rules import DcChainOpen, DcOffer
from driver.memdev import MemDev
from driver.region import Region, RegionPoisonError, create_region, list_regions, open_region

__all__ = ["CxlemuError", "DcChainOpen", "DcOffer", "DeviceFileDamaged", "DeviceFileError", "DeviceGone", "DeviceNotFound", "DmaError",
           "MailboxError", "MailboxTimeout", "MediaDisabled", "MemDev", "NoExtent", "NoSpace", "NoSuchHost", "PoisonError", "PortClaimed", "Region",
           "RegionPoisonError", "UnsafePath", "create_region", "list_regions", "open_region"]
