"""The machinery: decode loop, draft tree, verification, offloaded-experts runtime."""
