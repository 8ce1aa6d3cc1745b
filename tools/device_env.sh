# Sourced at the start of a device call (DEVELOPERS.md, "On a lent GPU machine"), from the repository root: the
# package and the carried wheels on PYTHONPATH, NVLink multicast off, unbuffered output; then the wheels of `.whl`
# (pydantic and the rest the GPU image lacks) installed once per machine into /tmp/site. Its status is the
# install's, so a caller can refuse to go on without them.
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
