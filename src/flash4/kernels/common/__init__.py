"""Device building blocks shared by the flash4 kernels (layouts, wgmma, softmax, masks, barriers)."""
