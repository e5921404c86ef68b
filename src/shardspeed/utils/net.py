"""Local TCP ports for rendezvous (re-exported from `shardspeed.common.net`)."""

from ..common.net import free_port, port_is_free

__all__ = ["free_port", "port_is_free"]
