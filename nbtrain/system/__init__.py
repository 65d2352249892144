"""What nbtrain asks of the operating system: processes and signals, the private network
namespace, the ranks' store, the run registry, the shared step board.
"""
