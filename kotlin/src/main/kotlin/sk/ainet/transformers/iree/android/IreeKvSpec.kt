package sk.ainet.transformers.iree.android

/**
 * The geometry of a KV-cache graph set (CONTRACT §1). `libskainet_iree_kv.so` reads these fields by
 * name and type (`GetFieldID`), so their names and types are part of the ABI.
 */
data class IreeKvSpec(
    val nLayers: Int,
    val headDim: Int,
    val nKvHeads: Int,
    val nHeads: Int,
    val hiddenSize: Int,
    val vocabSize: Int,
    val slidingWindow: Int,
    val globalLayerPeriod: Int,
    val chunk: Int,
    val maskHeads: Int,
    val slidingRopeBase: Float,
    val globalRopeBase: Float,
) {
    companion object {
        /** FunctionGemma-270M, the seed's model. */
        @JvmStatic
        fun functionGemma270m() = IreeKvSpec(18, 256, 1, 4, 640, 262144, 512, 6, 32, 0, 10_000f, 1_000_000f)
    }
}
