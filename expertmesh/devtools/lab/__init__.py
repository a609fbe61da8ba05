"""The household lab (`expertmesh lab`): real processes in network namespaces on tbf-shaped links; see docs/lab.md."""
