//! ONNX operators implemented with Burn tensor ops, one family per file.
//!
//! Each op is a plain function from its inputs to its outputs. [`lookup`] maps an op type to
//! its function; the interpreter calls it and attaches the node's name to any error.

pub use crate::graph::op_api::{Inputs, OpContext, OpFn, OpOutput, PassMemo};

use crate::error::OpResult;
use crate::op_bail;
use crate::value::Value;

mod arg_reduce;
mod attention;
mod bits_misc;
mod bitwise;
mod broadcast;
mod causal_conv;
mod compare;
mod concat_split;
mod control_flow;
mod conv;
mod conv_transpose;
mod depth_space;
mod detection;
mod dropout;
mod einsum;
mod elementwise;
mod flex_attention;
mod gather;
pub(crate) mod generators;
mod grid;
mod image_misc;
mod linear_attention;
mod local_norm;
mod loss;
mod matmul;
mod misc;
mod normalization;
mod onnx_ml;
mod optional;
mod pad_tile;
mod pool;
mod pool_nd;
mod quant;
mod random;
mod recurrent;
mod reduce;
mod reshape;
mod resize;
mod rounding_trig;
mod scan;
mod scatter;
mod select;
mod sequence;
pub(crate) mod sequence_marks;
mod signal;
mod slice;
mod softmax;
mod strings;
mod tfidf;
mod training_optimizers;
mod tree_ensemble;
mod unary_math;
mod window;
mod windows_signal;

pub use broadcast::broadcast_shapes;
pub use matmul::pad_columns;
pub use quant::{ZERO_POINT_TYPE, annotate_zero_point_types};

/// Find the implementation of an op type of the default (`ai.onnx`) domain.
pub fn lookup(op_type: &str) -> Option<OpFn> {
    find(OPS, op_type)
}

/// Find the implementation of `op_type` in `domain` (empty: `ai.onnx`). Besides the
/// default domain: `FlexAttention` of `ai.onnx.preview`, ORT Training's optimizer ops of
/// `ai.onnx.preview.training`, and some of `ai.onnx.ml`.
pub fn lookup_in(domain: &str, op_type: &str) -> Option<OpFn> {
    match domain {
        "" | "ai.onnx" => lookup(op_type),
        "ai.onnx.preview" if op_type == "FlexAttention" => lookup(op_type),
        "ai.onnx.preview.training" => find(PREVIEW_TRAINING_OPS, op_type),
        "ai.onnx.ml" => find(ONNX_ML_OPS, op_type),
        _ => None,
    }
}

/// The ops that take sequence values: the sequence ops, the optional ops and the ones that
/// only pass values on (`Identity`, `If`, `Loop`).
const SEQUENCE_OPS: &[&str] = &[
    "Identity",
    "If",
    "Loop",
    "Optional",
    "OptionalHasElement",
    "OptionalGetElement",
    "SequenceConstruct",
    "SequenceInsert",
    "SequenceAt",
    "SequenceErase",
    "SequenceLength",
    "ConcatFromSequence",
    "SequenceMap",
];

/// The ops that take string tensors: the string ops, `Equal`, `LabelEncoder`, and the
/// ones that only pass values on or hold them.
const STRING_OPS: &[&str] = &[
    "Identity",
    "If",
    "Loop",
    "Optional",
    "OptionalGetElement",
    "OptionalHasElement",
    "SequenceConstruct",
    "SequenceInsert",
    "Equal",
    "LabelEncoder",
    "StringConcat",
    "StringSplit",
    "RegexFullMatch",
    "StringNormalizer",
];

/// Refuse a sequence given to an op that takes tensors (every op outside
/// `SEQUENCE_OPS`) and strings given to an op that computes on numbers (every op outside
/// `STRING_OPS`), naming the input.
pub fn refuse_unsupported_kinds(op_type: &str, args: &[Option<Value>]) -> OpResult<()> {
    for (k, arg) in args.iter().enumerate() {
        match arg {
            Some(Value::Sequence(_)) if !SEQUENCE_OPS.contains(&op_type) => {
                op_bail!("input {k} is a sequence; {op_type} takes tensors")
            }
            Some(Value::Str(_)) if !STRING_OPS.contains(&op_type) => {
                op_bail!("input {k} holds strings; {op_type} takes numeric tensors")
            }
            _ => {}
        }
    }
    Ok(())
}

fn find(table: &[(&str, OpFn)], op_type: &str) -> Option<OpFn> {
    table
        .iter()
        .find(|(name, _)| *name == op_type)
        .map(|(_, f)| *f)
}

/// The ops of `ai.onnx.ml`.
const ONNX_ML_OPS: &[(&str, OpFn)] = &[
    ("ArrayFeatureExtractor", onnx_ml::array_feature_extractor),
    ("Binarizer", onnx_ml::binarizer),
    ("LabelEncoder", onnx_ml::label_encoder),
    ("TreeEnsemble", tree_ensemble::tree_ensemble),
];

/// The ops of `ai.onnx.preview.training`.
const PREVIEW_TRAINING_OPS: &[(&str, OpFn)] = &[
    ("Adagrad", training_optimizers::adagrad),
    ("Adam", training_optimizers::adam),
    ("Momentum", training_optimizers::momentum),
];

/// The supported op types, sorted.
pub fn supported() -> Vec<&'static str> {
    let mut v: Vec<_> = OPS.iter().map(|(n, _)| *n).collect();
    v.sort_unstable();
    v
}

const OPS: &[(&str, OpFn)] = &[
    // element-wise arithmetic and activations
    ("Add", elementwise::add),
    ("Sub", elementwise::sub),
    ("Mul", elementwise::mul),
    ("Div", elementwise::div),
    ("Pow", elementwise::pow),
    ("Max", elementwise::max),
    ("Min", elementwise::min),
    ("Sum", elementwise::sum),
    ("Relu", elementwise::relu),
    ("LeakyRelu", elementwise::leaky_relu),
    ("Elu", elementwise::elu),
    ("Sigmoid", elementwise::sigmoid),
    ("HardSigmoid", elementwise::hard_sigmoid),
    ("Tanh", elementwise::tanh),
    ("Gelu", elementwise::gelu),
    ("Erf", elementwise::erf),
    ("Exp", elementwise::exp),
    ("Log", elementwise::log),
    ("Sqrt", elementwise::sqrt),
    ("Reciprocal", elementwise::reciprocal),
    ("Neg", elementwise::neg),
    ("Abs", elementwise::abs),
    ("Softplus", elementwise::softplus),
    ("Clip", elementwise::clip),
    ("Identity", elementwise::identity),
    ("PRelu", elementwise::prelu),
    ("HardSwish", elementwise::hard_swish),
    ("Mod", elementwise::modulo),
    ("Sin", rounding_trig::sin),
    ("Cos", rounding_trig::cos),
    ("Floor", rounding_trig::floor),
    ("Ceil", rounding_trig::ceil),
    ("Round", rounding_trig::round),
    ("Sign", rounding_trig::sign),
    ("Tan", unary_math::tan),
    ("Asin", unary_math::asin),
    ("Acos", unary_math::acos),
    ("Atan", unary_math::atan),
    ("Sinh", unary_math::sinh),
    ("Cosh", unary_math::cosh),
    ("Asinh", unary_math::asinh),
    ("Acosh", unary_math::acosh),
    ("Atanh", unary_math::atanh),
    ("Selu", unary_math::selu),
    ("Celu", unary_math::celu),
    ("Mish", unary_math::mish),
    ("Swish", unary_math::swish),
    ("Softsign", unary_math::softsign),
    ("ThresholdedRelu", unary_math::thresholded_relu),
    ("Shrink", unary_math::shrink),
    ("Mean", unary_math::mean),
    ("IsNaN", unary_math::is_nan),
    ("IsInf", unary_math::is_inf),
    // bits
    ("BitwiseAnd", bitwise::bitwise_and),
    ("BitwiseOr", bitwise::bitwise_or),
    ("BitwiseXor", bitwise::bitwise_xor),
    ("BitwiseNot", bitwise::bitwise_not),
    ("BitShift", bitwise::bit_shift),
    ("Xor", bitwise::xor),
    // comparison and selection
    ("Equal", compare::equal),
    ("Less", compare::less),
    ("LessOrEqual", compare::less_or_equal),
    ("Greater", compare::greater),
    ("GreaterOrEqual", compare::greater_or_equal),
    ("Not", compare::not),
    ("And", compare::and),
    ("Or", compare::or),
    ("Where", compare::where_op),
    // linear algebra
    ("MatMul", matmul::matmul),
    ("Gemm", matmul::gemm),
    ("Einsum", einsum::einsum),
    ("RNN", recurrent::rnn),
    ("GRU", recurrent::gru),
    ("LSTM", recurrent::lstm),
    // convolution and pooling
    ("Conv", conv::conv),
    ("ConvTranspose", conv_transpose::conv_transpose),
    ("MaxPool", pool::max_pool),
    ("AveragePool", pool::average_pool),
    ("GlobalAveragePool", pool::global_average_pool),
    ("GlobalMaxPool", pool::global_max_pool),
    // normalisation
    ("LayerNormalization", normalization::layer_norm),
    ("BatchNormalization", normalization::batch_norm),
    ("InstanceNormalization", normalization::instance_norm),
    ("GroupNormalization", normalization::group_norm),
    ("RMSNormalization", normalization::rms_norm),
    ("Attention", attention::attention),
    ("RotaryEmbedding", attention::rotary_embedding),
    ("Softmax", softmax::softmax),
    ("LogSoftmax", softmax::log_softmax),
    ("SoftmaxCrossEntropyLoss", loss::softmax_cross_entropy_loss),
    (
        "NegativeLogLikelihoodLoss",
        loss::negative_log_likelihood_loss,
    ),
    ("Dropout", dropout::dropout),
    // random generators
    ("RandomUniform", random::random_uniform),
    ("RandomNormal", random::random_normal),
    ("RandomUniformLike", random::random_uniform_like),
    ("RandomNormalLike", random::random_normal_like),
    ("Bernoulli", random::bernoulli),
    ("Multinomial", random::multinomial),
    ("LpNormalization", local_norm::lp_normalization),
    ("LRN", local_norm::lrn),
    (
        "MeanVarianceNormalization",
        local_norm::mean_variance_normalization,
    ),
    // reductions
    ("ReduceMean", reduce::reduce_mean),
    ("ReduceSum", reduce::reduce_sum),
    ("ReduceMax", reduce::reduce_max),
    ("ReduceMin", reduce::reduce_min),
    ("ReduceL2", reduce::reduce_l2),
    ("ReduceSumSquare", reduce::reduce_sum_square),
    ("ReduceLogSumExp", reduce::reduce_log_sum_exp),
    ("ReduceL1", reduce::reduce_l1),
    ("ReduceProd", reduce::reduce_prod),
    ("ReduceLogSum", reduce::reduce_log_sum),
    ("ArgMax", arg_reduce::argmax),
    ("ArgMin", arg_reduce::argmin),
    ("CumSum", scan::cumsum),
    ("CumProd", scan::cumprod),
    // shape movement
    ("Reshape", reshape::reshape),
    ("Flatten", reshape::flatten),
    ("Transpose", reshape::transpose),
    ("Squeeze", reshape::squeeze),
    ("Unsqueeze", reshape::unsqueeze),
    ("Expand", reshape::expand),
    ("Concat", concat_split::concat),
    ("Split", concat_split::split),
    ("Slice", slice::slice),
    ("Gather", gather::gather),
    ("GatherElements", gather::gather_elements),
    ("GatherND", scatter::gather_nd),
    ("ScatterND", scatter::scatter_nd),
    ("ScatterElements", scatter::scatter_elements),
    ("Scatter", scatter::scatter_elements),
    ("TopK", select::top_k),
    ("Compress", select::compress),
    ("NonZero", select::non_zero),
    ("OneHot", select::one_hot),
    ("Hardmax", select::hardmax),
    ("EyeLike", select::eye_like),
    ("DepthToSpace", depth_space::depth_to_space),
    ("SpaceToDepth", depth_space::space_to_depth),
    ("Pad", pad_tile::pad),
    ("Tile", pad_tile::tile),
    ("Trilu", scan::trilu),
    ("Resize", resize::resize),
    ("Upsample", resize::upsample),
    // control flow (subgraphs)
    ("If", control_flow::if_op),
    ("Loop", control_flow::loop_op),
    ("Scan", control_flow::scan_op),
    // value generators and casts
    ("Shape", generators::shape),
    ("Size", generators::size),
    ("Range", generators::range),
    ("ConstantOfShape", generators::constant_of_shape),
    ("Cast", generators::cast),
    ("CastLike", generators::cast_like),
    // quantization
    ("QuantizeLinear", quant::quantize_linear),
    ("DequantizeLinear", quant::dequantize_linear),
    ("DynamicQuantizeLinear", quant::dynamic_quantize_linear),
    ("MatMulInteger", quant::matmul_integer),
    ("ConvInteger", quant::conv_integer),
    ("QLinearMatMul", quant::qlinear_matmul),
    ("QLinearConv", quant::qlinear_conv),
    // sampling grids, image and signal ops
    ("GridSample", grid::grid_sample),
    ("AffineGrid", grid::affine_grid),
    ("Col2Im", image_misc::col2im),
    ("CenterCropPad", image_misc::center_crop_pad),
    ("MaxUnpool", image_misc::max_unpool),
    ("LpPool", image_misc::lp_pool),
    ("RoiAlign", image_misc::roi_align),
    ("Unique", misc::unique),
    ("ReverseSequence", misc::reverse_sequence),
    ("Optional", optional::optional),
    ("OptionalHasElement", optional::optional_has_element),
    ("OptionalGetElement", optional::optional_get_element),
    // sequences
    ("SequenceEmpty", sequence::sequence_empty),
    ("SequenceConstruct", sequence::sequence_construct),
    ("SequenceInsert", sequence::sequence_insert),
    ("SequenceAt", sequence::sequence_at),
    ("SequenceErase", sequence::sequence_erase),
    ("SequenceLength", sequence::sequence_length),
    ("SplitToSequence", sequence::split_to_sequence),
    ("ConcatFromSequence", sequence::concat_from_sequence),
    ("SequenceMap", sequence::sequence_map),
    // strings
    ("StringConcat", strings::string_concat),
    ("StringSplit", strings::string_split),
    ("RegexFullMatch", strings::regex_full_match),
    ("StringNormalizer", strings::string_normalizer),
    ("Det", misc::det),
    ("HannWindow", windows_signal::hann_window),
    ("HammingWindow", windows_signal::hamming_window),
    ("BlackmanWindow", windows_signal::blackman_window),
    ("DFT", signal::dft),
    ("STFT", signal::stft),
    ("MelWeightMatrix", signal::mel_weight_matrix),
    ("NonMaxSuppression", detection::non_max_suppression),
    ("DeformConv", detection::deform_conv),
    ("BitCast", bits_misc::bit_cast),
    ("TensorScatter", bits_misc::tensor_scatter),
    ("CausalConvWithState", causal_conv::causal_conv_with_state),
    ("LinearAttention", linear_attention::linear_attention),
    ("FlexAttention", flex_attention::flex_attention),
    ("TfIdfVectorizer", tfidf::tfidf_vectorizer),
];
