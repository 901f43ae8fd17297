"""Compatibility layers that let code written for other training frameworks run on trainrun."""
