"""The host side: open a device, speak the mailbox, program decoders, move data."""
from emulator.spec.errors import (CxlemuError, DeviceGone, DeviceNotFound, DmaError, MailboxError,
                                  MailboxTimeout, MediaDisabled, PoisonError)

from driver.memdev import MemDev
from driver.region import Region, RegionPoisonError, create_region, list_regions, open_region

__all__ = ["CxlemuError", "DeviceGone", "DeviceNotFound", "DmaError", "MailboxError", "MailboxTimeout",
           "MediaDisabled", "MemDev", "PoisonError", "Region", "RegionPoisonError", "create_region", "list_regions",
           "open_region"]
