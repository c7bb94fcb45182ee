"""The launcher: locate, prepare and run NVIDIA Triton Inference Server as a child process group (the bundled binary of nvidia-pytriton or a system install); standard library only.
May import: specdec_wire, specdec.config, specdec.errors, specdec.triton_models.keys."""
from specdec.launcher.install import BACKEND_STUB_NAME, DEFAULT_MODEL_REPOSITORY, ModelRepositoryNotFoundError, REPO_ROOT, ServerExitedError, ServerTimeoutError, TritonInstall, TritonLaunchError, TritonNotFoundError, default_cache_dir, find_triton_install, prepare_backend_dir, server_environment
from specdec.launcher.processes import descendants, free_port, free_ports, group_members
from specdec.launcher.server import Endpoints, TritonServer
from specdec.launcher.serve import serve_main

__all__ = [
    "BACKEND_STUB_NAME",
    "DEFAULT_MODEL_REPOSITORY",
    "Endpoints",
    "ModelRepositoryNotFoundError",
    "REPO_ROOT",
    "ServerExitedError",
    "ServerTimeoutError",
    "TritonInstall",
    "TritonLaunchError",
    "TritonNotFoundError",
    "TritonServer",
    "default_cache_dir",
    "find_triton_install",
    "free_port",
    "free_ports",
    "group_members",
    "descendants",
    "prepare_backend_dir",
    "serve_main",
    "server_environment",
]
