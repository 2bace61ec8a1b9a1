"""Experts off the device: expert discovery, the host store, admission, the runtime and its MoE layer, expert compute and copy engines, prefetch sinks."""
