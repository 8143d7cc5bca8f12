"""trainwright: pipeline- and data-parallel training when memory and network are the limit."""

__version__ = "0.1.0"
