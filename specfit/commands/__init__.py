"""The jobs behind ``specfit <command>``; each takes a composed config."""
