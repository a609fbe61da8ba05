"""Zeroconf on the loopback is one for the whole machine: every test run on it (another worker's,
another checkout's) sees every advertisement and answers for every name it holds. Tests that assert
on everything they see, or take fixed names, advertise and browse a service type of this process's
own instead (conftest's `own_service_type`); the rest keep the real type in a cluster of their own."""

from __future__ import annotations

import os

SERVICE_TYPE = f"_em{os.getpid()}._tcp.local."  # a label of at most 15 characters, as DNS-SD allows
