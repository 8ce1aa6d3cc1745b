# Sourced from the repository root in a device call: the FlashAttention-4 wheels that travel in parts in the ignored
# `.fa4/` folder (one part per call: they outweigh one call's carry; DEVELOPERS.md, "FlashAttention-4"). Each call's
# files are stashed under /root/fa4; once every file `.fa4/SHA256` names has come, the split wheel is joined, every
# file checked, and the wheels installed once per machine into /tmp/site. Sets FA4_READY=1 when flash-attn-4 is
# installed, and puts the CuTe DSL's packages on PYTHONPATH (`pip --target` skips their .pth file). FA4_STASH and
# FA4_SITE name other folders (the tests).
FA4_STASH=${FA4_STASH:-/root/fa4}
FA4_SITE=${FA4_SITE:-/tmp/site}
FA4_READY=
mkdir -p $FA4_STASH
[ -d .fa4 ] && cp .fa4/* $FA4_STASH/ 2>/dev/null
if [ ! -d $FA4_SITE/flash_attn ] && [ -f $FA4_STASH/SHA256 ]; then
  fa4_missing=$(cd $FA4_STASH && awk '{print $2}' SHA256 | while read -r f; do
    case "$f" in *.part*) [ -f "$f" ] || echo "$f" ;; *) [ -f "$f" ] || ls "$f".part* >/dev/null 2>&1 || echo "$f" ;; esac
  done)
  if [ -n "$fa4_missing" ]; then
    echo "FlashAttention-4 wheels still to carry:" $fa4_missing
  else
    (cd $FA4_STASH && for whole in $(awk '{print $2}' SHA256 | grep -v '\.part'); do
       [ -f "$whole" ] || cat "$whole".part* > "$whole"; done \
     && sha256sum -c --quiet SHA256 \
     && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $FA4_SITE $(ls *.whl)) \
      || echo "the FlashAttention-4 wheels do not match .fa4/SHA256 or did not install"
  fi
fi
if [ -d $FA4_SITE/flash_attn ]; then
  FA4_READY=1
  export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi
