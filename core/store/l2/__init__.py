"""The shared tier (L2): chunk objects kept in a store that servers on many hosts share.

``value`` is what one stored value holds (header, key, checksum, payload) and how a read is checked;
``backend`` is what a tier's store must provide, ``choose_backend`` picks it from an address, and
``valkey_backend`` is the Valkey cluster behind it.
"""
