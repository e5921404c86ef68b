"""DeepSpeed's `deepspeed.utils.comms_logging`: the communication logger lives in comm/logger.py."""

from shardspeed.comm.logger import CommsLogger, bus_factor, configure_comms_logger, log_summary

__all__ = ["CommsLogger", "bus_factor", "configure_comms_logger", "log_summary"]
