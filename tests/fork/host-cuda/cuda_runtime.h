/* SPDX-License-Identifier: Apache-2.0 */
/*
 * host-cuda/cuda_runtime.h - the few CUDA runtime names that the patched
 * csrc/kvtrace_cuda_sites.h and tests/fork/cuda_sites.cu use, for a g++
 * build of the CUDA ops' probe sites where no CUDA toolkit is installed
 * (tests/fork/Makefile, libfork_cuda_sites_host.so).
 *
 * The sites are compiled as host code in any case (nvcc hands host code to
 * the host compiler); the tests give them host tensors only, whose path
 * never calls the runtime.  So these functions are never called: each
 * returns an error, which the sites treat as "no index to read", should that
 * ever change.  Values follow the CUDA runtime's enums.
 */
#ifndef KVTRACE_HOST_CUDA_RUNTIME_H
#define KVTRACE_HOST_CUDA_RUNTIME_H

#include <stddef.h>

typedef struct CUstream_st *cudaStream_t;

enum cudaError { cudaSuccess = 0, cudaErrorNotSupported = 801 };
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
	cudaMemcpyHostToHost = 0,
	cudaMemcpyHostToDevice = 1,
	cudaMemcpyDeviceToHost = 2,
	cudaMemcpyDeviceToDevice = 3,
	cudaMemcpyDefault = 4
};

enum cudaStreamCaptureStatus {
	cudaStreamCaptureStatusNone = 0,
	cudaStreamCaptureStatusActive = 1,
	cudaStreamCaptureStatusInvalidated = 2
};

static inline cudaError_t cudaStreamIsCapturing(cudaStream_t,
						enum cudaStreamCaptureStatus *)
{
	return cudaErrorNotSupported;
}

static inline cudaError_t cudaGetLastError(void)
{
	return cudaSuccess;
}

static inline cudaError_t cudaMemcpyAsync(void *, const void *, size_t,
					  enum cudaMemcpyKind, cudaStream_t)
{
	return cudaErrorNotSupported;
}

static inline cudaError_t cudaStreamSynchronize(cudaStream_t)
{
	return cudaErrorNotSupported;
}

#endif
