"""Operators, each in its own folder with its backends beside the naive reference they are tested
against (the layout of flash-linear-attention): ops -> layers (`linattn.attention`) -> models."""
