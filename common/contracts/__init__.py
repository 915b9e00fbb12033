"""worldloop's contracts: what every process agrees on, and nothing that moves data.

- ``config`` (with ``config_fields``, ``config_checks``, ``config_load``): the typed config tree;
- ``schemas``: the msgspec message types and their decoders of untrusted bytes;
- ``keys``: every Redis key name;
- ``modeling``: the token layout of a trajectory and its log-probs;
- ``logprobs``: chunked log-probs and entropy.

A contract imports only other contracts (``tools/check_layers.py``).
"""
