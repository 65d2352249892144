"""A rank's process machinery: its life from fork to exit, the run's settings on it, the
debugger relay, and what a cell's libraries do differently on a rank (displays, progress
bars, saved files, experiment trackers, the stop at a step).
"""
