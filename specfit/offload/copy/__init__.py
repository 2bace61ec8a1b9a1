"""Copy engines: move a layer's missing experts from the host store into device cache slots."""
