"""Prioritized experience replay backed by Redis: ``table.py`` is the concept, ``service.py``
the gRPC boundary, ``client.py`` the typed client, ``__main__.py`` the process."""
