"""Shared test code (procs) and the scripts the tests run as __main__."""
