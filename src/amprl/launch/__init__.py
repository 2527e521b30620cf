"""Starting the services as local processes (``amprl run``)."""
