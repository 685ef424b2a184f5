// Index builders of the GPT and blended datasets (megalite/data/index_builders.py has the numpy twins).
//
// Both are sequential scans over up to hundreds of millions of entries: a loop in Python would take minutes, and
// the blending choice (which dataset is furthest behind its weight) depends on every earlier choice, so numpy cannot
// vectorize it. Each function's result must equal its numpy twin element for element; a test checks that.
//
// Only pybind11 (shipped inside torch's include directory) is used, not torch itself: the arrays are numpy's.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// sample_idx[j] = (k, offset): token j * seq_length of the stream formed by the documents doc_idx[0], doc_idx[1], ...
// is token `offset` of document doc_idx[k], where k is the unique position with start(k) <= j * seq_length <
// start(k + 1) (so empty documents are never chosen). Sample j is the seq_length + 1 tokens from sample_idx[j]
// through sample_idx[j + 1] inclusive: consecutive samples share one token, the last label of one being the first
// input of the next, so no token is dropped or repeated as a prediction target.
py::array_t<int64_t> build_sample_idx(const Int32Array& sizes, const Int64Array& doc_idx, int64_t seq_length,
                                      int64_t num_samples) {
  if (seq_length < 1 || num_samples < 0) throw std::invalid_argument("need seq_length >= 1 and num_samples >= 0");
  const int64_t num_sizes = sizes.size(), num_docs = doc_idx.size();
  py::array_t<int64_t> result({num_samples + 1, static_cast<int64_t>(2)});
  const int32_t* size = sizes.data();
  const int64_t* doc = doc_idx.data();
  int64_t* out = result.mutable_data();
  std::string error;
  {
    py::gil_scoped_release release;
    int64_t k = 0, start = 0;  // position in doc_idx, and the stream position of that document's first token
    for (int64_t j = 0; j <= num_samples && error.empty(); ++j) {
      const int64_t position = j * seq_length;
      while (k < num_docs) {
        const int64_t id = doc[k];
        if (id < 0 || id >= num_sizes) {
          error = "doc_idx[" + std::to_string(k) + "] = " + std::to_string(id) + " is not a document";
          break;
        }
        if (start + size[id] > position) break;
        start += size[id];
        ++k;
      }
      if (error.empty() && k == num_docs) error = "the documents hold too few tokens for the samples";
      out[2 * j] = k;
      out[2 * j + 1] = position - start;
    }
  }
  if (!error.empty()) throw std::invalid_argument(error);
  return result;
}

// Sample i of the blend comes from the dataset furthest behind its share: argmax_d weights[d] * (i + 1) - taken[d],
// the lowest d on ties. dataset_sample_index[i] is how many samples that dataset had given before.
py::tuple build_blending_indices(const DoubleArray& weights, int64_t size) {
  const int64_t num_datasets = weights.size();
  if (num_datasets < 1 || num_datasets > 32767) throw std::invalid_argument("need 1 to 32767 datasets");
  if (size < 0) throw std::invalid_argument("need size >= 0");
  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  const double* weight = weights.data();
  int16_t* chosen_out = dataset_index.mutable_data();
  int64_t* sample_out = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> taken(num_datasets, 0);
    for (int64_t i = 0; i < size; ++i) {
      int64_t chosen = 0;
      double best = 0.0;
      for (int64_t d = 0; d < num_datasets; ++d) {
        // volatile: the product must be rounded before the subtraction, exactly as Python computes it; a fused
        // multiply-add (which the compiler may emit on targets that have one) rounds once and could break a tie
        // differently from the numpy twin.
        volatile double target = weight[d] * static_cast<double>(i + 1);
        const double error = target - static_cast<double>(taken[d]);
        if (d == 0 || error > best) {
          best = error;
          chosen = d;
        }
      }
      chosen_out[i] = static_cast<int16_t>(chosen);
      sample_out[i] = taken[chosen]++;
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Sample-index and blending-index builders of megalite's GPT and blended datasets";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
        py::arg("num_samples"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
