package sk.ainet.transformers.iree.android

import kotlin.math.min

/**
 * The seed's decoder: [prefillPrefix] once per shared prefix, then [generate] per utterance
 * (restore, chunk calls of `spec.chunk`, greedy steps), with per-stage milliseconds.
 * [prefillSeq] is SEQ of the prefill graph: the prefix is padded to it; a longer prefix continues
 * in chunk calls.
 */
class IreeKvDecoder(val session: IreeKvSession, val prefillSeq: Int) {

    class Generation(
        val ids: IntArray,
        val stoppedAtEos: Boolean,
        val restoreMs: Long,
        val chunkMs: Long,
        val decodeMs: Long,
    )

    private val chunk = session.spec.chunk

    fun prefillPrefix(ids: IntArray): IreeKvSession.Snapshot {
        require(ids.isNotEmpty()) { "empty prefix" }
        val head = min(ids.size, prefillSeq)
        val padded = IntArray(prefillSeq)
        ids.copyInto(padded, 0, 0, head)
        session.prefill(padded, head)
        feed(ids, head)
        return session.snapshot()
    }

    /** Feeds `ids[from until size]` in chunk calls; returns the last call's next id. */
    private fun feed(ids: IntArray, from: Int): Int {
        var next = -1
        val buffer = IntArray(chunk)
        var i = from
        while (i < ids.size) {
            val n = min(chunk, ids.size - i)
            buffer.fill(0)
            ids.copyInto(buffer, 0, i, i + n)
            next = session.chunk(buffer, n)
            i += n
        }
        return next
    }

    /** Greedy ids after the prefix and [utteranceIds], stopping at [eos] (not included) or [maxNew]. */
    fun generate(snapshot: IreeKvSession.Snapshot, utteranceIds: IntArray, eos: Int, maxNew: Int): Generation {
        require(utteranceIds.isNotEmpty()) { "empty utterance" }
        var t = System.nanoTime()
        session.restore(snapshot)
        val restoreMs = (System.nanoTime() - t) / 1_000_000
        t = System.nanoTime()
        var token = feed(utteranceIds, 0)
        val chunkMs = (System.nanoTime() - t) / 1_000_000
        t = System.nanoTime()
        val out = ArrayList<Int>(maxNew)
        var stopped = false
        while (out.size < maxNew) {
            if (token == eos) {
                stopped = true
                break
            }
            out.add(token)
            if (out.size == maxNew) break
            token = session.step(token)
        }
        val decodeMs = (System.nanoTime() - t) / 1_000_000
        return Generation(out.toIntArray(), stopped, restoreMs, chunkMs, decodeMs)
    }
}
