"""The emulated CXL Type-3 device: register file, mailbox, HDM decoders, media, firmware runner."""
