"""Drop-in replacements for other frameworks' offload helpers."""
