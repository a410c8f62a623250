"""Test stand-in for MindSpeed (see ../README.md)."""
