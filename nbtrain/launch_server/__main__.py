"""``python -m nbtrain.launch_server``: started by the kernel, never by hand."""

from nbtrain.launch_server.server import main

main()
