"""Image data: IDX files, CIFAR-10, ImageFolder trees, and the classification DataModule."""
