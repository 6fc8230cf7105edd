"""How staticrt has inductor's C++ built: the same code as inductor writes, in fewer and smaller
g++ runs (`kernel_libraries`, `aoti_runtime`)."""
