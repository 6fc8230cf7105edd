# Sourced by bench/gpu.sh on a lent GPU machine whose image lacks staticrt's extras: installs the
# wheels carried in .whl or .whl2 (../shared/gpu/wheels.txt lists them) into /tmp/site once, and
# joins onnxruntime-gpu from its two parts (bench/ort_parts.py split: part a carried in .whl/a by
# one call, kept in /tmp/ort-a; part b in .whl2/b by the next) into /tmp/ortsite, with the CUDA
# libraries torch's wheel brings on the loader's path. A machine with the extras installed skips it.
for carried in .whl .whl2; do
    if compgen -G "$carried/*.whl" >/dev/null && ! PYTHONPATH=/tmp/site "$py" -c "import fastapi, openai" 2>/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$carried"/*.whl || exit 9
    fi
done
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl/a ]; then
    mkdir -p /tmp/ort-a && cp -r .whl/a/. /tmp/ort-a/
fi
if [ -d .whl2/b ] && [ -n "$(ls /tmp/ort-a 2>/dev/null)" ] && [ ! -d /tmp/ortsite/onnxruntime ]; then
    "$py" bench/ort_parts.py join /tmp/ort-a .whl2/b /tmp/ortsite || exit 8
fi
if [ -d /tmp/ortsite/onnxruntime ]; then
    export PYTHONPATH="/tmp/ortsite:$PYTHONPATH"
    nvidia=$("$py" -c "import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), 'nvidia'))")
    libs=$(find "$nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
