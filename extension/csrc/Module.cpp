// torch_lms._C: the torch._C Large Model Support bindings of a patched build
// (the shared torch/csrc/cuda/LmsBindings.cpp), on a stock PyTorch wheel whose
// caching allocator sits behind the LMS allocator (StockAllocatorBackend.h).

#include "StockAllocatorBackend.h"

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/cuda/LmsBindings.h>
#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <utility>

namespace py = pybind11;

namespace torch_lms {
namespace {

namespace lms = c10::cuda::lms;

c10::DeviceIndex checkedDevice(int64_t device) {
  // Like torch.cuda.memory_stats(): statistics need an initialized allocator.
  torch::utils::device_lazy_init(at::kCUDA);
  return torch::cuda::lms::checkedDevice(device);
}

// Enabling needs the allocator hook that makes adoption safe (its trace of
// private pools), which needs CUDA initialized.
void setEnabled(bool enabled) {
  if (enabled) {
    torch::utils::device_lazy_init(at::kCUDA);
    attachAllocatorHooks();
  }
  lms::setEnabled(enabled);
}

py::dict stats(int64_t device) {
  return torch::cuda::lms::statsToDict(lms::getStats(checkedDevice(device)));
}

// The storage of a tensor or an UntypedStorage (null when it has none).
c10::intrusive_ptr<c10::StorageImpl> storageOf(PyObject* obj) {
  c10::StorageImpl* storage = nullptr;
  if (THPVariable_Check(obj)) {
    const at::Tensor& tensor = THPVariable_Unpack(obj);
    if (tensor.defined()) {
      storage =
          tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
    }
  } else if (THPStorage_Check(obj)) {
    storage = THPStorage_Unpack(obj).unsafeGetStorageImpl();
  } else {
    TORCH_CHECK_TYPE(
        false,
        "Large Model Support: expected a torch.Tensor or torch.UntypedStorage, "
        "got ",
        Py_TYPE(obj)->tp_name);
  }
  if (storage == nullptr) {
    return {};
  }
  return c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage);
}

// Raw data access from Python (Tensor.data_ptr, UntypedStorage.data_ptr):
// pages a swapped-out storage in. Storage-less tensors (fake, functional,
// wrapper subclasses) and unmanaged storages pass through untouched.
void accessRaw(py::handle obj) {
  c10::intrusive_ptr<c10::StorageImpl> storage = storageOf(obj.ptr());
  if (!storage || storage->device_type() != c10::DeviceType::CUDA ||
      !lms::isManaged(storage->_mutable_data_ptr_no_checks())) {
    return;
  }
  py::gil_scoped_release no_gil;
  lms::access(*storage);
}

// Replaces a binding of the shared set (m.def would add an overload that is
// tried after the original).
template <typename F>
void replace(py::module_& m, const char* name, F&& f) {
  m.attr(name) = py::cpp_function(
      torch::wrap_pybind_function(std::forward<F>(f)),
      py::name(name),
      py::scope(m));
}

} // namespace
} // namespace torch_lms

PYBIND11_MODULE(_C, m) {
  using namespace torch_lms;
  m.doc() =
      "Large Model Support for a stock PyTorch wheel: the torch._C LMS "
      "bindings of a patched build, with an LMS allocator in front of the "
      "unmodified CUDA caching allocator.";

  installAllocator();
  applyEnvironmentConfig();

  torch::cuda::lms::initLmsBindings(m.ptr());
  replace(m, "_cuda_lms_setEnabled", &setEnabled);
  replace(m, "_cuda_lms_stats", &stats);

  // The extension's own functions (not part of the torch._C contract).
  m.def("_torch_lms_access", torch::wrap_pybind_function(&accessRaw));
}
