"""dflash."""
